"""stages.generate through the HF backend on a tiny model that ends its replies (tests/tiny.add_stop_bias).

Rows follow the contract of docs/guides/generate.md: the loss mask lies exactly on generated ids, turn j's prompt holds
the target's own earlier replies, the template text between replies is the template's; first/last options;
same settings give the same bytes; long prompts and empty replies are recorded; resume rules.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from cli_run import peagle

from peagle_pipeline.config import GenerateConfig
from peagle_pipeline.data.dialogue import REASON_EMPTY, REASON_TOO_LONG
from peagle_pipeline.data.onpolicy_files import rejects_file, rows_file
from peagle_pipeline.errors import BadInput, ResumeMismatch
from peagle_pipeline.stages.generate import stage

ROW_KEYS = {"id", "source", "source_row", "sample", "messages", "input_ids", "loss_mask", "finish"}
EOT = "<|im_end|>"
# a seed for which the stop model's sampled first replies to the 4 prompts are all non-empty
SEED_NO_EMPTY_REPLY = 8


def _cfg(model: Path, data: Path, out: Path, **kw) -> GenerateConfig:
    base = dict(
        model=str(model),
        data=[str(data)],
        output=str(out),
        backend="hf",
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=24,
        chunk_size=4,
        batch_size=3,
        compute_dtype="fp32",
        device="cpu",
        max_samples=10,
    )
    return GenerateConfig(**{**base, **kw})


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / rows_file(0, 1)).read_text().splitlines()]


def _rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / rejects_file(0, 1)).read_text().splitlines()]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.fixture(scope="module")
def multi_turn(tiny_stop_model, conversations, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "all"
    stage.run(_cfg(tiny_stop_model, conversations, out, samples_per_prompt=2))
    return out


def test_rows_carry_generated_ids_with_the_mask_exactly_on_them(multi_turn, tiny_stop_model, conversations):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_stop_model)
    eot = tok.convert_tokens_to_ids(EOT)
    source = [json.loads(line)["messages"] for line in conversations.read_text().splitlines()]
    rows = _rows(multi_turn)
    assert rows and any(len(r["finish"]) > 1 for r in rows)  # some conversations went past turn 1
    for row in rows:
        assert set(row) == ROW_KEYS and row["id"] == f"{row['source_row']}-{row['sample']}"
        ids, mask, msgs = row["input_ids"], row["loss_mask"], row["messages"]
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        runs = _runs(mask)
        assert len(runs) == len(replies) == len(row["finish"])
        original = source[row["source_row"]]
        users = [m["content"] for m in original if m["role"] == "user"]
        assert [m for m in msgs if m["role"] == "user"] == [
            {"role": "user", "content": u} for u in users[: len(runs)]
        ]
        assert runs[-1][1] == len(ids)  # the row ends with the last generated token
        for j, ((a, b), text, finish) in enumerate(zip(runs, replies, row["finish"], strict=True)):
            body = ids[a:b]
            if finish == "stop":
                assert body[-1] == eot and eot not in body[:-1]
                body = body[:-1]
            else:
                assert b - a == 24 and eot not in body
            assert tok.decode(body) == text  # the message text is the decoded generated ids
            assert text != original[2 * j + 1]["content"]  # the original reply is not reused
            # the template's own text before each reply: (separator,) the user turn, the generation prompt
            before = tok.decode(ids[runs[j - 1][1] : a]) if j else tok.decode(ids[:a])
            user = f"<|im_start|>user\n{users[j]}{EOT}\n<|im_start|>assistant\n"
            assert before == ("\n" + user if j else user)
    state = json.loads(next(multi_turn.glob("state-*.json")).read_text())
    assert state["complete"] and state["rows"] == len(rows)
    assert state["replies"] == sum(len(r["finish"]) for r in rows)
    assert state["supervised_tokens"] == sum(sum(r["loss_mask"]) for r in rows)


def test_samples_differ_and_same_settings_give_the_same_bytes(
    multi_turn, tiny_stop_model, conversations, tmp_path
):
    rows = _rows(multi_turn)
    by_id = {r["id"]: r for r in rows}
    pairs = [(by_id[f"{i}-0"], by_id[f"{i}-1"]) for i in range(10) if f"{i}-0" in by_id and f"{i}-1" in by_id]
    assert pairs and any(a["input_ids"] != b["input_ids"] for a, b in pairs)
    again = tmp_path / "again"
    stage.run(_cfg(tiny_stop_model, conversations, again, samples_per_prompt=2))
    assert (again / rows_file(0, 1)).read_bytes() == (multi_turn / rows_file(0, 1)).read_bytes()
    assert (again / rejects_file(0, 1)).read_bytes() == (multi_turn / rejects_file(0, 1)).read_bytes()
    batch = tmp_path / "batch5"  # each request samples from its own stream: the batch size changes no row
    stage.run(_cfg(tiny_stop_model, conversations, batch, samples_per_prompt=2, batch_size=5))
    assert (batch / rows_file(0, 1)).read_bytes() == (multi_turn / rows_file(0, 1)).read_bytes()
    other = tmp_path / "seed1"
    stage.run(_cfg(tiny_stop_model, conversations, other, samples_per_prompt=2, seed=1))
    assert (other / rows_file(0, 1)).read_bytes() != (multi_turn / rows_file(0, 1)).read_bytes()


def test_first_and_last_turns(tiny_stop_model, conversations, tmp_path):
    source = [json.loads(line)["messages"] for line in conversations.read_text().splitlines()]
    stage.run(_cfg(tiny_stop_model, conversations, tmp_path / "first", turns="first"))
    for row in _rows(tmp_path / "first"):
        assert len(row["finish"]) == 1 and [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["messages"][0] == source[row["source_row"]][0]
    stage.run(_cfg(tiny_stop_model, conversations, tmp_path / "last", turns="last"))
    rows = _rows(tmp_path / "last")
    assert any(len(r["messages"]) > 2 for r in rows)
    for row in rows:
        original = source[row["source_row"]]
        assert len(row["finish"]) == 1 and len(row["messages"]) == len(original)
        assert row["messages"][:-1] == original[:-1]  # earlier original replies kept as context
        assert len(_runs(row["loss_mask"])) == 1 and row["loss_mask"][-1] == 1


def test_prompts_without_replies_get_the_targets_reply(tiny_stop_model, tmp_path):
    """Prompt-only rows, e.g. a list of questions: each
    gets one generated reply, and extract reads the rows as token ids."""
    from peagle_pipeline.data.formats import iter_rows
    from peagle_pipeline.data.records import TokenizedConversation

    data = tmp_path / "prompts.jsonl"
    prompts = [[{"role": "user", "content": f"Question {i}: why is the sky blue?"}] for i in range(3)]
    prompts.append(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    )
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in prompts))
    summary = stage.run(_cfg(tiny_stop_model, data, tmp_path / "gen", seed=SEED_NO_EMPTY_REPLY))
    rows = sorted(_rows(tmp_path / "gen"), key=lambda r: r["source_row"])
    assert [r["source_row"] for r in rows] == [0, 1, 2, 3] and summary.rows == 4
    for row in rows:
        assert row["messages"][:-1] == prompts[row["source_row"]]
        assert row["messages"][-1]["role"] == "assistant" and len(row["finish"]) == 1
        (run,) = _runs(row["loss_mask"])
        assert run[1] == len(row["input_ids"])  # the one supervised span is the generated reply, at the end
    read = list(iter_rows([tmp_path / "gen"]))
    assert len(read) == 4 and all(isinstance(r, TokenizedConversation) for r in read)


def test_long_prompts_and_empty_replies_are_recorded(tiny_stop_model, conversations, tmp_path):
    summary = stage.run(_cfg(tiny_stop_model, conversations, tmp_path / "short", max_prompt_tokens=40))
    rejects = _rejects(tmp_path / "short")
    assert any(r["reason"] == REASON_TOO_LONG and "sample" not in r for r in rejects)
    assert summary.rejects.get(REASON_TOO_LONG, 0) >= 1
    for row in _rows(tmp_path / "short"):
        starts = [a for a, _ in _runs(row["loss_mask"])]
        assert all(s <= 40 for s in starts)  # every reply was prompted with <= max_prompt_tokens tokens
    # greedy: this model's most likely first token is the end-of-turn, so every reply is empty; no row is kept, which
    # is an error naming the reason (as extract's "no usable samples"), and nothing is left
    with pytest.raises(
        BadInput, match=rf"every row was rejected \(10 x '{REASON_EMPTY}'\); nothing was kept"
    ):
        stage.run(_cfg(tiny_stop_model, conversations, tmp_path / "greedy", temperature=0.0))
    assert not (tmp_path / "greedy").exists()


def test_rerun_is_a_no_op_and_other_settings_are_refused(tiny_stop_model, conversations, tmp_path):
    out = tmp_path / "gen"
    stage.run(_cfg(tiny_stop_model, conversations, out, max_samples=3))
    before = (out / rows_file(0, 1)).read_bytes()
    again = stage.run(_cfg(tiny_stop_model, conversations, out, max_samples=3))
    assert again.already_complete and (out / rows_file(0, 1)).read_bytes() == before
    other_batch = stage.run(_cfg(tiny_stop_model, conversations, out, max_samples=3, batch_size=2))
    assert other_batch.already_complete  # the batch size is not a setting the rows depend on
    with pytest.raises(ResumeMismatch, match="temperature: 1.0 there, 0.5 now"):
        stage.run(_cfg(tiny_stop_model, conversations, out, max_samples=3, temperature=0.5))


def test_cli_errors_are_one_line(tiny_stop_model, conversations, tmp_path):
    out = tmp_path / "gen"
    common = ["generate", "--model", str(tiny_stop_model), "--data", str(conversations), "--output", str(out)]
    flags = ["--backend", "hf", "--max-samples", "2", "--max-new-tokens", "8", "--compute-dtype", "fp32"]
    proc = peagle(*common, *flags)
    assert proc.stdout.startswith(f"generated {rows_file(0, 1)} in {out} with hf")
    proc = peagle(*common, *flags, "--top-p", "0.5", check=False)
    assert (
        proc.returncode == 5 and proc.stderr.count("\n") == 1 and "top_p: 0.95 there, 0.5 now" in proc.stderr
    )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    proc = peagle(*common[:-1], str(foreign), *flags, check=False)
    assert proc.returncode == 6 and "not a generate output" in proc.stderr
    proc = peagle(*common, "--temperature", "-1", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: temperature must be >= 0, got -1.0"


def test_ranks_split_the_rows_and_share_generate_json(tiny_stop_model, conversations, tmp_path, monkeypatch):
    out = tmp_path / "dp"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (1, 0):  # rank from the torchrun environment, as under torchrun
        monkeypatch.setenv("RANK", str(rank))
        summary = stage.run(_cfg(tiny_stop_model, conversations, out))
        assert summary.rows_file == rows_file(rank, 2)
    seen: dict[int, set[int]] = {}
    for rank in (0, 1):
        rows = [json.loads(x) for x in (out / rows_file(rank, 2)).read_text().splitlines()]
        rejects = [json.loads(x) for x in (out / rejects_file(rank, 2)).read_text().splitlines()]
        seen[rank] = {r["source_row"] for r in rows + rejects}
        assert seen[rank] and all(i % 2 == rank for i in seen[rank])
    assert seen[0] | seen[1] == set(range(10))
    assert json.loads((out / "generate.json").read_text())["settings"]["world_size"] == 2


def test_a_template_that_writes_the_date_gets_the_outputs_start(
    tiny_stop_model, conversations, tmp_path, monkeypatch
):
    """Llama 3's template writes "Today Date" (`strftime_now`): generate.json records the time the output was
    started (`info.template_time`) and every rank, and every resume, prompts with that date, so a run across
    midnight or resumed days later keeps its conversations and its rows reproducible."""
    from transformers import AutoTokenizer

    model = shutil.copytree(tiny_stop_model, tmp_path / "dated")
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n' }}" + tok.chat_template
    tok.save_pretrained(model)
    out = tmp_path / "gen"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    stage.run(_cfg(model, conversations, out, turns="first"))
    meta = json.loads((out / "generate.json").read_text())
    started = datetime.fromisoformat(meta["info"]["template_time"])
    assert abs((datetime.now() - started).total_seconds()) < 600
    meta["info"]["template_time"] = "2001-02-03T23:59:59"  # as if the output had been started then
    (out / "generate.json").write_text(json.dumps(meta))
    monkeypatch.setenv("RANK", "1")
    stage.run(_cfg(model, conversations, out, turns="first"))

    def dates(rank: int) -> set[str]:
        rows = [json.loads(x) for x in (out / rows_file(rank, 2)).read_text().splitlines()]
        assert rows
        return {tok.decode(r["input_ids"]).split("Today Date: ")[1][:11] for r in rows}

    assert dates(0) == {f"{started:%d %b %Y}"} and dates(1) == {"03 Feb 2001"}


def test_extract_refuses_rows_another_target_generated(
    tiny_stop_model, tiny_qwen3, conversations, tmp_path, capsys
):
    from peagle_pipeline.cli import main

    gen = tmp_path / "gen"
    stage.run(_cfg(tiny_stop_model, conversations, gen, max_samples=2, max_new_tokens=8))
    flags = ["--data", str(gen), "--compute-dtype", "fp32", "--device", "cpu", "--topk", "4"]
    capsys.readouterr()
    code = main(["extract", "--model", str(tiny_qwen3), "--output", str(tmp_path / "no"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "no").exists()
    assert f"{gen} was generated by {tiny_stop_model.resolve()}, not {tiny_qwen3}" in err
    assert "(config.json and tokenizer differ)" in err and "--allow-other-target" in err
    # deliberate: a warning, and the cache is written
    code = main(
        [
            "extract",
            "--model",
            str(tiny_qwen3),
            "--output",
            str(tmp_path / "x"),
            *flags,
            "--allow-other-target",
        ]
    )
    assert code == 0 and "warning: " in capsys.readouterr().err and (tmp_path / "x" / "cache.json").is_file()
    # the target that generated them: no word about it
    assert main(["extract", "--model", str(tiny_stop_model), "--output", str(tmp_path / "c"), *flags]) == 0
    assert "generated by" not in capsys.readouterr().err
