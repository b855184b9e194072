"""On-policy rows (token ids + loss mask) go into the cache unchanged; the mask-token rule reads the cache.

Real tiny HF model, real extraction, real cache: the stored `input_ids`/`loss_mask` must equal the rows',
every-token counts must be recorded, and a special token seen in the data must never become the mask token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.stages.extract import stage
from peagle_pipeline.stages.train.draft import choose_mask_token

pytestmark = pytest.mark.slow


def _rows(n: int, vocab: int, seed: int = 0, extra_id: int | None = None) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [2] + [rng.randrange(7, vocab) for _ in range(rng.randint(3, 12))] + [3, 2]
        reply = [rng.randrange(7, vocab) for _ in range(rng.randint(2, 20))] + [3]
        if extra_id is not None and i == 1:
            reply[0] = extra_id
        rows.append({"input_ids": prompt + reply, "loss_mask": [0] * len(prompt) + [1] * len(reply)})
    return rows


def _extract(model: Path, data: Path, out: Path, **over) -> None:
    cfg = dict(model=str(model), data=[str(data)], output=str(out), topk=8, shard_tokens=128, chunk_tokens=32)
    cfg.update(over)
    stage.run(ExtractConfig(**cfg))


def test_token_id_rows_round_trip_unchanged(tiny_model, tmp_path):
    rows = _rows(12, 400)
    rows.insert(5, {"input_ids": [2, 450, 3], "loss_mask": [0, 1, 1]})  # 450 is outside the tokenizer (400)
    text = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"}]}
    data = tmp_path / "onpolicy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*rows, text]))
    _extract(tiny_model, data, tmp_path / "c", max_length=24)
    cache = open_cache(tmp_path / "c")
    assert verify_cache(cache) == []
    rejects = dict(zip(cache.rejects["sample_id"], cache.rejects["reason"], strict=True))
    assert "outside the tokenizer" in rejects[5]
    all_ids = []
    for sid, row in enumerate(rows):
        if sid == 5:
            continue
        a = cache.read_arrays(sid)
        n = min(len(row["input_ids"]), 24)  # max_length truncates like any other row
        assert a["input_ids"].tolist() == row["input_ids"][:n]
        assert a["loss_mask"].astype(int).tolist() == row["loss_mask"][:n]
        all_ids += row["input_ids"][:n]
    text_ids = cache.read_arrays(len(rows))["input_ids"].tolist()  # the text row was rendered as usual
    expected = np.bincount(np.array(all_ids + text_ids), minlength=cache.meta.vocab_size)
    assert np.array_equal(cache.all_token_counts(), expected)


def test_mask_token_is_an_unused_special_token_never_seen_in_the_data(tiny_model_factory, tmp_path):
    from transformers import AutoTokenizer

    # embedding rows == tokenizer size, so no unused row exists and rule 4 (special tokens) decides
    n = len(AutoTokenizer.from_pretrained(tiny_model_factory()))
    model = tiny_model_factory(vocab_size=n)
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(6, n)))
    _extract(model, data, tmp_path / "a")
    choice = choose_mask_token(open_cache(tmp_path / "a"), n, override=None)
    # specials: <pad> 0, bos 1, <|im_start|> 2, <|im_end|> 3 (eos, ends every reply), <|start_header_id|> 4
    assert (choice.token_id, choice.warning) == (4, None)
    seen = tmp_path / "b.jsonl"  # id 4 occurs in one reply: the next unused special token is chosen
    seen.write_text("".join(json.dumps(r) + "\n" for r in _rows(6, n, extra_id=4)))
    _extract(model, seen, tmp_path / "b")
    assert choose_mask_token(open_cache(tmp_path / "b"), n, override=None).token_id == 5
    forced = choose_mask_token(open_cache(tmp_path / "b"), n, override=4)
    assert forced.token_id == 4 and "occurs 1 times" in forced.warning


# ---- token-id rows and assistant_turns -------------------------------------------------------------------
def test_assistant_turns_last_keeps_only_the_last_reply_of_token_id_rows(tiny_model, tmp_path):
    """A token-id row's replies are its runs of supervised tokens (generate supervises each reply, never the template
    text between them): `--assistant-turns last` supervises the last run only, as it does for text rows."""
    two_turns = {
        "input_ids": [2, 40, 41, 3, 60, 61, 62, 3, 2, 42, 3, 2, 70, 71, 3],
        "loss_mask": [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1],
    }
    one_turn = {"input_ids": [2, 40, 3, 2, 80, 81, 3], "loss_mask": [0, 0, 0, 0, 1, 1, 1]}
    data = tmp_path / "onpolicy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (two_turns, one_turn)))
    _extract(tiny_model, data, tmp_path / "last", assistant_turns="last")
    cache = open_cache(tmp_path / "last")
    assert cache.meta.assistant_turns == "last"
    a = cache.read_arrays(0)
    assert a["input_ids"].tolist() == two_turns["input_ids"]
    assert a["loss_mask"].astype(int).tolist() == [0] * 12 + [1, 1, 1]
    assert cache.read_arrays(1)["loss_mask"].astype(int).tolist() == one_turn["loss_mask"]
    _extract(tiny_model, data, tmp_path / "all")  # the default still supervises every reply
    assert (
        open_cache(tmp_path / "all").read_arrays(0)["loss_mask"].astype(int).tolist()
        == two_turns["loss_mask"]
    )
