"""kill -9 a real `peagle-pipeline generate` (HF backend, tiny model) in the middle of a chunk commit and between
commits; re-running the same command must give files byte-identical to an uninterrupted run.

PEAGLE_TEST_GENERATE_SLEEP widens the window between a chunk's appended rows and its state update, so the kill
leaves rows past the committed length on disk (they must be truncated, not kept or duplicated).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_argv import PEAGLE, end_of_killed_runs, start_cli
from cli_run import run_cli

from peagle_pipeline.data.onpolicy_files import SLEEP_ENV, rejects_file, rows_file, state_file

pytestmark = [pytest.mark.crash, pytest.mark.slow]

FLAGS = [
    "--backend",
    "hf",
    "--compute-dtype",
    "fp32",
    "--device",
    "cpu",
    "--temperature",
    "1.0",
    "--max-new-tokens",
    "24",
    "--max-samples",
    "16",
    "--chunk-size",
    "2",
    "--batch-size",
    "2",
]


def _cmd(model: Path, data: Path, out: Path) -> list[str]:
    return [*PEAGLE, "generate", "--model", str(model), "--data", str(data), "--output", str(out), *FLAGS]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)
    env.pop("PEAGLE_DEBUG", None)
    return env


def _state(out: Path) -> dict | None:
    try:
        return json.loads((out / state_file(0, 1)).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _mid_commit(out: Path) -> bool:
    """A chunk after the first has its rows on disk but not its state update (the process sleeps in between)."""
    st, rows = _state(out), out / rows_file(0, 1)
    return st is not None and st["chunks"] >= 1 and rows.stat().st_size > st["rows_bytes"]


def _kill_when(cmd: list[str], env: dict[str, str], ready, timeout: float = 240) -> None:
    proc = start_cli(
        cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, (
                f"generate finished before the kill point: {proc.stderr.read()[-2000:]}"
            )
            assert time.monotonic() < deadline, "timed out waiting for the kill point"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        end_of_killed_runs()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def test_kill_9_then_resume_gives_the_same_bytes(tiny_stop_model, conversations, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    done = run_cli(_cmd(tiny_stop_model, conversations, ref), _env())
    assert done.returncode == 0, done.stderr[-2000:]
    slow = _env(**{SLEEP_ENV: "1.0"})
    _kill_when(_cmd(tiny_stop_model, conversations, out), slow, lambda: _mid_commit(out))
    st = _state(out)
    assert st is not None and not st["complete"]
    assert (out / rows_file(0, 1)).stat().st_size > st["rows_bytes"]  # uncommitted rows were on disk
    _kill_when(  # a second kill, after at least one more chunk committed in the resumed run
        _cmd(tiny_stop_model, conversations, out),
        slow,
        lambda: (_state(out) or {}).get("chunks", 0) > st["chunks"],
    )
    proc = run_cli(_cmd(tiny_stop_model, conversations, out), _env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in (rows_file(0, 1), rejects_file(0, 1), state_file(0, 1)):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert _state(out)["complete"] and _state(out)["rows"] > 0
