"""Rows that carry their own token ids and loss mask (on-policy data from `generate`): read as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peagle_pipeline.data.formats import iter_rows
from peagle_pipeline.data.onpolicy_files import META_FILE
from peagle_pipeline.data.records import Reject, TokenizedConversation


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_tokenized_row_wins_over_its_text(tmp_path):
    row = {"messages": [{"role": "user", "content": "x"}], "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    (out,) = list(iter_rows([_jsonl(tmp_path / "a.jsonl", [row])]))
    assert out == TokenizedConversation(str(tmp_path / "a.jsonl"), 0, [5, 6, 7], [False, True, True])


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"input_ids": [1, 2]}, "needs both"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "differ in length"),
        ({"input_ids": [1, -2], "loss_mask": [0, 1]}, "non-negative integers"),
        ({"input_ids": [1, 2.5], "loss_mask": [0, 1]}, "non-negative integers"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "0/1"),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "no supervised token"),
    ],
)
def test_bad_tokenized_rows_are_rejected_with_a_reason(tmp_path, row, reason):
    (out,) = list(iter_rows([_jsonl(tmp_path / "a.jsonl", [row])]))
    assert isinstance(out, Reject) and reason in out.reason


def test_tokenized_rows_from_parquet(tmp_path):
    table = pa.table({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]]})
    pq.write_table(table, tmp_path / "a.parquet")
    out = list(iter_rows([tmp_path / "a.parquet"]))
    assert [o.input_ids for o in out] == [[1, 2, 3], [4, 5]]
    assert out[1].loss_mask == [True, True] and out[1].source_row == 1


def _state(d: Path, rank: int, world: int, rows_bytes: int, complete: bool = True) -> None:
    name = f"state-rank{rank:05d}-of-{world:05d}.json"
    (d / name).write_text(
        json.dumps({"rank": rank, "world_size": world, "rows_bytes": rows_bytes, "complete": complete})
    )


def test_generate_output_dir_reads_committed_rows_in_rank_order(tmp_path):
    d = tmp_path / "gen"
    d.mkdir()
    (d / META_FILE).write_text("{}")
    r1 = _jsonl(d / "rows-rank00001-of-00002.jsonl", [{"input_ids": [9, 9], "loss_mask": [0, 1]}])
    r0 = _jsonl(
        d / "rows-rank00000-of-00002.jsonl",
        [{"input_ids": [1, 1], "loss_mask": [0, 1]}, {"input_ids": [2, 2], "loss_mask": [0, 1]}],
    )
    committed = r0.stat().st_size
    with open(r0, "a") as f:  # bytes a killed run left past the committed length are not data
        f.write('{"input_ids": [7, 7], "loss_m')
    _state(d, 0, 2, committed)
    _state(d, 1, 2, r1.stat().st_size)
    (d / "rejects-rank00000-of-00002.jsonl").write_text('{"reason": "too long"}\n')  # not a data file
    out = list(iter_rows([d]))
    assert [o.input_ids[0] for o in out] == [1, 2, 9]
    assert [o.source_row for o in out] == [0, 1, 2] and {o.source for o in out} == {str(d)}


def test_unfinished_generate_output_is_refused_before_reading(tmp_path):
    from peagle_pipeline.errors import BadInput

    d = tmp_path / "gen"
    d.mkdir()
    (d / META_FILE).write_text("{}")
    with pytest.raises(BadInput, match="no committed rank"):
        iter_rows([d])
    _state(d, 0, 2, 0)
    with pytest.raises(BadInput, match="1 of 2 ranks"):
        iter_rows([d])
    _state(d, 1, 2, 0, complete=False)
    with pytest.raises(BadInput, match="rank 1 is not complete"):
        iter_rows([d])
