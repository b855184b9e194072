"""data.onpolicy_files: the state file is the commit marker; bytes past it are dropped on open; settings checked."""

from __future__ import annotations

import json

import pytest

from peagle_pipeline.data.onpolicy_files import (
    FORMAT,
    ChunkOutput,
    OnPolicyWriter,
    prepare_output,
    rows_file,
    state_file,
)
from peagle_pipeline.errors import Busy, IncompatibleCache, OutputExists, ResumeMismatch

META = {"format": FORMAT, "settings": {"temperature": 0.7, "turns": "all"}, "info": {"version": "1"}}


def _chunk(n: int, reason: str = "too long") -> ChunkOutput:
    rows = [{"id": f"{i}-0", "input_ids": [1, 2, i], "loss_mask": [0, 1, 1], "text": "é"} for i in range(n)]
    return ChunkOutput(rows=rows, rejects=[{"reason": reason}], replies=n, generated_tokens=2 * n)


def test_commit_appends_and_records_and_reopen_truncates(tmp_path):
    root = prepare_output(tmp_path / "out", META)
    w = OnPolicyWriter(root, 1, 2).open()
    w.commit(_chunk(2))
    w.commit(_chunk(1, "empty reply"))
    w.close()
    rows = root / rows_file(1, 2)
    committed = rows.read_bytes()
    assert committed.decode().count("\n") == 3 and "é" in committed.decode()  # UTF-8, not \u escapes
    st = json.loads((root / state_file(1, 2)).read_text())
    assert (st["chunks"], st["rows"], st["rows_bytes"], st["replies"]) == (2, 3, len(committed), 3)
    assert st["reject_reasons"] == {"empty reply": 1, "too long": 1} and not st["complete"]
    with open(rows, "ab") as f:  # what a kill between append and state update leaves
        f.write(b'{"id": "torn')
    w = OnPolicyWriter(root, 1, 2).open()
    assert rows.read_bytes() == committed and w.chunks_done == 2
    w.finish()
    w.close()
    assert OnPolicyWriter(root, 1, 2).open().complete


def test_damaged_files_and_a_held_lock(tmp_path):
    root = prepare_output(tmp_path / "out", META)
    w = OnPolicyWriter(root, 0, 1).open()
    with pytest.raises(Busy):
        OnPolicyWriter(root, 0, 1).open()
    w.commit(_chunk(2))
    w.close()
    (root / rows_file(0, 1)).write_bytes(b"{}\n")
    with pytest.raises(IncompatibleCache, match="bytes but"):
        OnPolicyWriter(root, 0, 1).open()


def test_prepare_output_checks_settings_and_ownership(tmp_path):
    root = prepare_output(tmp_path / "out", META)
    assert prepare_output(root, {**META, "info": {"version": "2"}}) == root  # info is not compared
    other = {**META, "settings": {"temperature": 0.0, "turns": "all"}}
    with pytest.raises(ResumeMismatch, match=r"settings.temperature: 0.7 there, 0.0 now"):
        prepare_output(root, other)
    with pytest.raises(IncompatibleCache, match="format"):
        prepare_output(root, {**META, "format": "peagle-onpolicy/0"})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("x")
    with pytest.raises(OutputExists):
        prepare_output(foreign, META)
