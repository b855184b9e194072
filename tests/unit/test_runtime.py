"""runtime: atomic writes, the crash-test pause, rank discovery, per-rank locks, claiming an output directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from peagle_pipeline.errors import OutputExists
from peagle_pipeline.runtime import claim_output_dir


def test_create_exclusive(tmp_path):
    from peagle_pipeline.runtime import create_exclusive

    path = tmp_path / "meta.json"
    assert create_exclusive(path, "first\n") and not create_exclusive(path, "second\n")
    assert path.read_text() == "first\n" and [p.name for p in tmp_path.iterdir()] == ["meta.json"]


# ---------------------------------------------------------------- atomic files, locks, ranks, the crash-test hook
def test_atomic_writes_leave_no_temp_and_a_plain_file_mode(tmp_path):
    import json
    import os
    import stat

    from peagle_pipeline.runtime import atomic_copy, atomic_write_bytes, atomic_write_json, fsync_file

    atomic_write_bytes(tmp_path / "a.bin", b"old")
    atomic_write_bytes(tmp_path / "a.bin", b"new")
    atomic_write_json(tmp_path / "b.json", {"z": 1, "a": [2]})
    assert (tmp_path / "a.bin").read_bytes() == b"new"
    assert (tmp_path / "b.json").read_text() == '{\n  "a": [\n    2\n  ],\n  "z": 1\n}\n'
    assert json.loads((tmp_path / "b.json").read_text()) == {"z": 1, "a": [2]}
    atomic_copy(tmp_path / "a.bin", tmp_path / "copy.bin")
    fsync_file(tmp_path / "copy.bin")
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "copy.bin").read_bytes() == b"new"
    assert stat.S_IMODE((tmp_path / "copy.bin").stat().st_mode) == 0o666 & ~mask  # not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.json", "copy.bin"]


def test_pause_for_crash_test_sleeps_only_when_asked(monkeypatch):
    import time

    from peagle_pipeline.runtime import pause_for_crash_test

    monkeypatch.delenv("PEAGLE_TEST_SOME_SLEEP", raising=False)
    t0 = time.perf_counter()
    pause_for_crash_test("PEAGLE_TEST_SOME_SLEEP")
    assert time.perf_counter() - t0 < 0.05
    monkeypatch.setenv("PEAGLE_TEST_SOME_SLEEP", "0.2")
    t0 = time.perf_counter()
    pause_for_crash_test("PEAGLE_TEST_SOME_SLEEP")
    assert time.perf_counter() - t0 >= 0.2


def test_rank_world_from_env(monkeypatch):
    from peagle_pipeline.runtime import rank_world_from_env

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert rank_world_from_env(None, None) == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert rank_world_from_env(None, None) == (3, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rank_world_from_env(None, None) == (1, 2)  # torchrun before SLURM
    assert rank_world_from_env(0, 8) == (0, 8)  # explicit values win


def test_rank_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    import subprocess
    import sys

    from peagle_pipeline.errors import Busy
    from peagle_pipeline.runtime import RankLock

    path = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from peagle_pipeline.runtime import RankLock; "
            f"RankLock({str(path)!r}, 'store').acquire(); print('held', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            Busy, match=rf"store is already being written by another process \(pid {holder.pid}\)"
        ):
            RankLock(path, "store").acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RankLock(path, "store").acquire()  # the kernel dropped the dead holder's lock
    assert path.read_text().split()[0] == str(os.getpid())
    lock.release()


def test_claim_accepts_an_empty_or_own_directory_and_refuses_a_foreign_one(tmp_path):
    claim_output_dir(tmp_path / "new", "cache.json", "a peagle cache")
    assert (tmp_path / "new").is_dir()
    (tmp_path / "new" / ".peagle-tmp-1").write_text("ours")
    claim_output_dir(tmp_path / "new", "cache.json", "a peagle cache")
    (tmp_path / "new" / "notes.txt").write_text("theirs")
    with pytest.raises(OutputExists, match=r"is not a peagle cache \(it holds 'notes.txt'"):
        claim_output_dir(tmp_path / "new", "cache.json", "a peagle cache")


def test_claim_joins_a_directory_another_rank_starts_between_its_two_looks(tmp_path, monkeypatch):
    """Rank A sees no marker; rank B's exclusive create lands; A's listing then holds the marker (the window that
    failed CI for an object store, and the same on local disk)."""
    root = tmp_path / "cache"
    root.mkdir()
    marker = root / "cache.json"
    real_exists = Path.exists

    def exists_then_other_rank_claims(self: Path, *a, **kw) -> bool:
        found = real_exists(self, *a, **kw)
        if self == marker and not found:
            marker.write_text("{}")
        return found

    monkeypatch.setattr(Path, "exists", exists_then_other_rank_claims)
    claim_output_dir(root, "cache.json", "a peagle cache")
    monkeypatch.undo()
    assert marker.read_text() == "{}"
