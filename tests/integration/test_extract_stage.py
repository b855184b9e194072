"""stages.extract in-process with the tiny model's real tokenizer/pieces and a deterministic fake backend.

Fast checks of the runner: batch planning, rank split, rejects, Ctrl-C commits and resumes exactly (the fake's
outputs depend on batch composition, so a resume that re-formed different batches would differ), no-op re-run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cache_compare import assert_same_cache
from fakes import FakeBackend

from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.data.records import Conversation, Message, Reject, rank_rows
from peagle_pipeline.errors import BadInput, Interrupted
from peagle_pipeline.stages.extract import stage
from peagle_pipeline.stages.extract.batch_plan import (
    PlannedSample,
    RowReject,
    plan_batches,
    render_rows,
    sort_by_length,
)


def _planned(lengths: list[int]) -> list[PlannedSample]:
    from peagle_pipeline.cache.writer import SampleRecord

    return [PlannedSample(i, SampleRecord(i, "s", i), [1] * n, [True] * n) for i, n in enumerate(lengths)]


def test_plan_batches_greedy_in_order():
    items = _planned([300, 500, 200, 900, 2000, 10, 10])
    items.insert(2, RowReject(99, "s", 99, "bad"))
    out = list(plan_batches(items, 1024))
    shapes = [x.reason if isinstance(x, RowReject) else [len(s.input_ids) for s in x] for x in out]
    assert shapes == ["bad", [300, 500], [200], [900], [2000], [10, 10]]


def test_sort_by_length_in_windows_renumbers_storage_positions():
    items = _planned([5, 2, 9, 2, 7, 3, 1])
    items.insert(3, RowReject(99, "s", 99, "bad"))
    out = list(sort_by_length(items, window=4))
    # the reject passes at once; window 1 = rows 0..3 sorted (stable: row 1 before row 3), window 2 = rows 4..6
    assert isinstance(out[0], RowReject) and out[0].reason == "bad"
    samples = out[1:]
    assert [s.record.sample_id for s in samples] == [1, 3, 0, 2, 6, 5, 4]
    assert [len(s.input_ids) for s in samples] == [2, 2, 5, 9, 1, 3, 7]
    assert [s.ordinal for s in samples] == list(range(7))  # storage positions stay consecutive


def test_sorted_windows_pad_less_on_alternating_lengths():
    # on-policy data alternates short and long rows: in row order every batch pads a short row to a long one
    lengths = [50, 400] * 8

    def computed(items: list) -> int:
        return sum(max(len(s.input_ids) for s in b) * len(b) for b in plan_batches(items, 1024))

    assert computed(_planned(lengths)) == 8 * 800
    assert computed(list(sort_by_length(_planned(lengths), window=256))) == sum(lengths) == 3600


def test_rank_rows_split_after_max_samples():
    rows = list(range(10))
    assert [i for i, _ in rank_rows(rows, 1, 3, None)] == [1, 4, 7]
    assert [i for i, _ in rank_rows(rows, 0, 2, 5)] == [0, 2, 4]


class _Renderer:
    def render(self, messages, max_tokens=None):
        from peagle_pipeline.data.chat import RejectRow, RenderedSample

        n = len(messages[0].content)
        if n == 0:
            raise RejectRow("nothing to say")
        return RenderedSample(list(range(n)), [i % 2 == 1 for i in range(n)])


def test_render_rows_rejects_and_truncation():
    def conv(i, text):
        return (i, Conversation("f", i, [Message("user", text)]))

    rows = [
        conv(0, "abcdef"),
        (1, Reject("f", 1, "malformed JSON")),
        conv(2, ""),
        conv(3, "a" * 20),
        conv(4, "x"),
    ]
    out = list(render_rows(rows, _Renderer(), max_length=8, overlong="truncate"))
    kinds = [(type(o).__name__, getattr(o, "reason", None)) for o in out]
    assert kinds == [
        ("PlannedSample", None),
        ("RowReject", "malformed JSON"),
        ("RowReject", "nothing to say"),
        ("PlannedSample", None),
        ("RowReject", "shorter than 2 tokens"),
    ]
    assert out[3].record.truncated and len(out[3].input_ids) == 8 and out[3].ordinal == 1
    skip = list(render_rows(rows[3:4], _Renderer(), max_length=8, overlong="skip"))
    assert isinstance(skip[0], RowReject) and "max_length" in skip[0].reason


def _data(path: Path, n: int = 24) -> Path:
    lines = []
    for i in range(n):
        turns = [
            {"role": "user", "content": f"question {i} " + "word " * (i % 7 + 2)},
            {"role": "assistant", "content": "answer " * (i % 11 + 3)},
        ]
        lines.append(json.dumps({"messages": turns}))
    lines.insert(4, json.dumps({"messages": []}))
    path.write_text("\n".join(lines) + "\n")
    return path


class _Interrupting(FakeBackend):
    def __init__(self, *a, stop_at: int, **k):
        super().__init__(*a, **k)
        self.stop_at = stop_at

    def forward(self, batch):
        if len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        return super().forward(batch)


@pytest.fixture
def patch_backend(monkeypatch):
    made: list[FakeBackend] = []

    def use(stop_at: int | None = None):
        def factory(name, cfg, layer_ids):
            from peagle_pipeline.model_dir import read_target_info

            info = read_target_info(cfg.model)
            b = (
                FakeBackend(info, layer_ids, cfg.topk, cfg.last_hidden)
                if stop_at is None
                else _Interrupting(info, layer_ids, cfg.topk, cfg.last_hidden, stop_at=stop_at)
            )
            made.append(b)
            return b

        monkeypatch.setattr(stage, "get_backend", factory)
        return made

    return use


def _cfg(model: Path, data: Path, out: Path, **over) -> ExtractConfig:
    base = dict(
        model=str(model),
        data=[str(data)],
        output=str(out),
        shard_tokens=128,
        chunk_tokens=32,
        batch_tokens=256,
        topk=8,
    )
    base.update(over)
    return ExtractConfig(**base)


@pytest.mark.parametrize("stop_at", [1, 3, 6])
def test_ctrl_c_then_resume_is_identical(tiny_model, tmp_path, patch_backend, stop_at):
    data = _data(tmp_path / "d.jsonl")
    patch_backend()
    ref = stage.run(_cfg(tiny_model, data, tmp_path / "ref"))
    assert ref.samples == 24 and ref.rejects and not ref.already_complete
    patch_backend(stop_at=stop_at)
    with pytest.raises(Interrupted, match="re-run the same command"):
        stage.run(_cfg(tiny_model, data, tmp_path / "res"))
    made = patch_backend()
    again = stage.run(_cfg(tiny_model, data, tmp_path / "res"))
    assert again.samples == 24
    if stop_at > 1:  # commits happened before the interrupt: only the rest was recomputed
        assert again.new_tokens < ref.new_tokens
    assert made and made[0].calls  # the resumed run did real work
    assert_same_cache(tmp_path / "ref", tmp_path / "res")
    noop = stage.run(_cfg(tiny_model, data, tmp_path / "res"))
    assert noop.already_complete and "already complete" in noop.format()


def test_fp32_last_hidden_and_layer_validation(tiny_model, tmp_path, patch_backend):
    data = _data(tmp_path / "d.jsonl", 6)
    patch_backend()
    with pytest.raises(BadInput, match="outside 0..6"):
        stage.run(_cfg(tiny_model, data, tmp_path / "x", layers=[1, 7]))
    with pytest.raises(BadInput, match="topk"):
        stage.run(_cfg(tiny_model, data, tmp_path / "y", topk=100000))
    stage.run(_cfg(tiny_model, data, tmp_path / "c", layers=[6, 1], last_hidden=True))
    cache = open_cache(tmp_path / "c")
    assert cache.meta.aux_layer_ids == [1, 6] and cache.meta.has_last_hidden
    s = cache.read_sample(int(cache.samples["sample_id"][0]))
    assert s.last_hidden is not None and s.last_hidden.shape[1] == cache.meta.hidden_size
    assert (tmp_path / "c" / "extract.yaml").exists() and (
        tmp_path / "c" / "target" / "pieces.safetensors"
    ).exists()


def test_collapsed_default_layers_are_reported(tiny_model, tmp_path, patch_backend):
    """[2, L//2, L-3] on the 6-layer tiny model is [2, 3, 3] -> 2 aux layers; say so."""
    data = _data(tmp_path / "d.jsonl", 4)
    patch_backend()
    text = stage.run(_cfg(tiny_model, data, tmp_path / "c")).format()
    assert open_cache(tmp_path / "c").meta.aux_layer_ids == [2, 3]
    assert (
        "note: the default aux layers [2, L//2, L-3] of this 6-layer target are [2, 3, 3]: the draft gets 2 "
        "aux hidden states instead of 3; pass --layers to choose 3 distinct ids"
    ) in text
    chosen = stage.run(_cfg(tiny_model, data, tmp_path / "d", layers=[1, 3, 5])).format()
    assert "note:" not in chosen


def test_cache_files_follow_the_umask(tiny_model, tmp_path, patch_backend):
    """No file of a cache is private (0600): other users (a vLLM server, a trainer) read it."""
    import os

    data = _data(tmp_path / "d.jsonl", 4)
    patch_backend()
    old = os.umask(0o022)
    try:
        stage.run(_cfg(tiny_model, data, tmp_path / "c"))
    finally:
        os.umask(old)
    modes = {
        str(p.relative_to(tmp_path / "c")): p.stat().st_mode & 0o777
        for p in (tmp_path / "c").rglob("*")
        if p.is_file()
    }
    assert "target/pieces.safetensors" in modes and "target/config.json" in modes
    assert {k: m for k, m in modes.items() if m != 0o644} == {}


# ---- zero usable samples is an error naming the reasons; the output is left as it was ------
def _lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SYSTEM_ONLY = {"messages": [{"role": "system", "content": "be nice"}, {"role": "assistant", "content": "ok"}]}
USER_ONLY = {"messages": [{"role": "user", "content": "anyone?"}]}


@pytest.mark.parametrize("existed", [False, True])
def test_no_usable_samples_is_an_error_and_leaves_nothing(tiny_model, tmp_path, patch_backend, existed):
    data = _lines(tmp_path / "d.jsonl", [SYSTEM_ONLY, USER_ONLY, SYSTEM_ONLY])
    out = tmp_path / "c"
    if existed:
        out.mkdir()
    patch_backend()
    with pytest.raises(BadInput) as err:
        stage.run(_cfg(tiny_model, data, out))
    assert str(err.value) == (
        f"no usable samples in {data}: all 3 rows were rejected (2 x 'no assistant turn after the first user "
        "turn', 1 x 'no assistant turn'); nothing was written"
    )
    assert (sorted(out.iterdir()) == []) if existed else not out.exists()
    _data(data, 3)  # the data fixed in place: the same command now succeeds
    assert stage.run(_cfg(tiny_model, data, out)).samples == 3


@pytest.mark.parametrize("existed", [False, True])
def test_a_truncated_model_file_leaves_no_stamped_output(tiny_model, tmp_path, patch_backend, existed):
    """model.safetensors cut short (a download that stopped): one BadInput naming it, and the output folder as it
    was before the call (no cache.json, extract.yaml or temporary target folder left in it)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    blob = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    data, out = _data(tmp_path / "d.jsonl"), tmp_path / "c"
    if existed:
        out.mkdir()
    patch_backend()
    with pytest.raises(BadInput, match="model.safetensors"):
        stage.run(_cfg(model, data, out))
    assert (sorted(out.iterdir()) == []) if existed else not out.exists()
    shutil.copy(tiny_model / "model.safetensors", model / "model.safetensors")  # the download completed
    assert stage.run(_cfg(model, data, out)).samples == 24
    assert sorted(p.name for p in out.iterdir()) == ["cache.json", "extract.yaml", "stores", "target"]


def test_empty_data_and_max_length_1(tiny_model, tmp_path, patch_backend):
    patch_backend()
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(BadInput, match=rf"no usable samples: {empty} holds no rows; nothing was written"):
        stage.run(_cfg(tiny_model, empty, tmp_path / "c"))
    data = _data(tmp_path / "d.jsonl", 3)
    with pytest.raises(
        BadInput,
        match=r"all 4 rows were rejected \(3 x 'no supervised tokens within max_length', 1 x 'empty conversation'\)",
    ):
        stage.run(_cfg(tiny_model, data, tmp_path / "c", max_length=1))
    assert not (tmp_path / "c").exists()


def test_a_rank_without_samples_completes_an_empty_store(tiny_model, tmp_path, patch_backend):
    """One rank of several may get no usable row (here: rank 1 of 2 over a good and a bad row): not an error,
    its store completes empty (its summary prints no bytes/token) and the cache holds the other rank's sample."""
    patch_backend()
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = _lines(tmp_path / "d.jsonl", [good, USER_ONLY])
    stage.run(_cfg(tiny_model, data, tmp_path / "c", rank=0, world_size=2))
    text = stage.run(_cfg(tiny_model, data, tmp_path / "c", rank=1, world_size=2)).format()
    assert "samples 0, tokens 0, supervised 0\n" in text and "bytes/token" not in text
    assert "rejects 1\n       1  no assistant turn" in text
    assert len(open_cache(tmp_path / "c").samples) == 1


class _RunningAhead(FakeBackend):
    """A FakeBackend that, like HF on CUDA, can be handed batch i+1 before batch i's outputs are asked for."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.events: list[tuple[str, int]] = []

    def submit(self, batch):
        n = len(self.calls)
        self.events.append(("submit", n))
        outputs = self.forward(batch)

        def collect():
            self.events.append(("collect", n))
            return outputs

        return collect


def test_runner_submits_the_next_batch_before_writing_the_last(
    tiny_model, tmp_path, patch_backend, monkeypatch
):
    """Batch i+1 is enqueued before batch i is copied/written, and the cache is bit-identical to the
    one a forward-then-write backend gives (rejects included, recorded in the same order)."""
    data = _data(tmp_path / "d.jsonl")
    patch_backend()
    stage.run(_cfg(tiny_model, data, tmp_path / "ref"))
    made: list[_RunningAhead] = []

    def factory(name, cfg, layer_ids):
        from peagle_pipeline.model_dir import read_target_info

        made.append(_RunningAhead(read_target_info(cfg.model), layer_ids, cfg.topk, cfg.last_hidden))
        return made[-1]

    monkeypatch.setattr(stage, "get_backend", factory)
    stage.run(_cfg(tiny_model, data, tmp_path / "ahead"))
    n = len(made[0].calls)
    assert n >= 3
    expected = [("submit", 0)] + [e for i in range(1, n) for e in (("submit", i), ("collect", i - 1))]
    assert made[0].events == expected + [("collect", n - 1)]
    assert_same_cache(tmp_path / "ref", tmp_path / "ahead")
