"""Ctrl-C and a second start on a live run, with real `peagle-pipeline` subprocesses.

SIGINT goes to the whole process group, as a terminal sends it (the DataLoader worker gets it too). Training must
stop at a step boundary, save that step, exit 130 with one error line, and `--resume` must then finish with the
weights of an uninterrupted run. Before training starts, Ctrl-C leaves nothing that blocks the next start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_argv import PEAGLE, last_train_step, small_train_flags, wait_until
from cli_run import run_cli
from safetensors.torch import load_file

from peagle_pipeline.stages.train import metrics

pytestmark = [pytest.mark.crash, pytest.mark.slow]

STEPS = 120
FLAGS = small_train_flags(
    depths=4, tokens_per_step=256, steps=STEPS, eval_every=100, save_every=1000, num_workers=1, eval_samples=4
)


def _cmd(cache: Path, out: Path, *extra: str) -> list[str]:
    return [*PEAGLE, "train", "--cache", str(cache), "--output", str(out), *FLAGS, *extra]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PEAGLE_DEBUG", None)
    return env


def _start(cmd: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd,
        env={**_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _ctrl_c(proc: subprocess.Popen[str]) -> tuple[str, str]:
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the trainer and its DataLoader worker
    stdout, stderr = proc.communicate(timeout=120)
    return stdout, stderr


def _hold_fifo(proc: subprocess.Popen[str], fifo: Path) -> int:
    """Wait until `proc` opens the FIFO for reading, then hold its write end open (never writing): the process
    stays blocked in read() inside the command. Returns the write end's fd (close it after)."""
    fd: list[int] = []

    def opened() -> bool:
        try:
            fd.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader has it open
        except OSError:
            return False
        return True

    wait_until(proc, opened)
    time.sleep(0.2)
    return fd[0]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


LOG_EVERY = ("--log-every", "50")  # the stop lands inside the log window (50, 100]
STEP_S = 0.1  # PEAGLE_TEST_STEP_SLEEP of the interrupted run (the trainer's test hook)
TIMINGS = (
    "tokens_per_s",
    "data_wait",
    "step_time",
)  # the only figures of a record that differ from run to run


def test_ctrl_c_saves_the_step_and_resume_finishes_exactly(tiny_cache: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = run_cli(_cmd(tiny_cache, reference, *LOG_EVERY), _env())
    assert done.returncode == 0, done.stderr[-2000:]

    out = tmp_path / "run"
    # Steps of at least STEP_S: the record of step 50 appears while that step's bookkeeping still runs, so Ctrl-C
    # is sent a few steps later, inside the window (50, 100], never on its boundary and never near its end.
    proc = _start(_cmd(tiny_cache, out, *LOG_EVERY), PEAGLE_TEST_STEP_SLEEP=str(STEP_S))
    wait_until(proc, lambda: last_train_step(out) >= 50)
    time.sleep(5 * STEP_S)
    _, stderr = _ctrl_c(proc)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and sum(line.startswith("error:") for line in lines) == 1
    assert lines[-1].startswith("error: interrupted at step "), lines[-1]
    stopped = int(lines[-1].split("interrupted at step ")[1].split()[0])
    assert 50 < stopped < 100 and f"checkpoint step-{stopped} saved" in lines[-1] and "--resume" in lines[-1]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:08d}"
    assert not list((out / "checkpoints").glob("*.tmp"))

    again = run_cli(_cmd(tiny_cache, out, "--resume", *LOG_EVERY), _env())
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed {out} at step {stopped} of {STEPS}" in again.stderr

    # metrics.jsonl reads as the uninterrupted run's, the record of the interrupted window (step 100) included
    def figures(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMINGS} for r in metrics.read_metrics(run)]

    assert [r["step"] for r in figures(out) if r["kind"] == "train"] == [50, 100, 120]
    assert figures(out) == figures(reference)
    ref, got = _weights(reference, STEPS), _weights(out, STEPS)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_ctrl_c_before_training_leaves_nothing(tiny_cache: Path, tmp_path: Path) -> None:
    """The cache's cache.json is a FIFO: the start blocks reading it, inside the trainer's set-up."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.mkfifo(cache / "cache.json")
    out = tmp_path / "run"
    proc = _start(_cmd(cache, out))
    writer = _hold_fifo(proc, cache / "cache.json")
    _, stderr = _ctrl_c(proc)
    os.close(writer)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 130 and lines == [
        "error: interrupted before training started; re-run the same command to start"
    ], stderr[-2000:]
    assert not out.exists()


def test_second_start_on_a_live_run_is_busy(tiny_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _start(_cmd(tiny_cache, out, "--steps", "100000"))
    try:
        wait_until(first, lambda: last_train_step(out) >= 1)
        second = run_cli(_cmd(tiny_cache, out), _env())
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 7, second.stderr[-2000:]
        assert len(lines) == 1 and f"another process (pid {first.pid})" in lines[0], lines
        assert "rank" not in lines[0] and "--output" in lines[0]
    finally:
        _, stderr = _ctrl_c(first)
    assert first.returncode == 130 and "checkpoint step-" in stderr
    assert json.loads((out / "run.json").read_text())["starts"][0]["total_steps"] == 100000


def test_ctrl_c_in_verify_is_exit_130(tmp_path: Path) -> None:
    """Every command (not only extract and train): exit 130 and one line, never 0 and silence."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.mkfifo(cache / "cache.json")
    proc = _start([*PEAGLE, "verify", str(cache)])
    writer = _hold_fifo(proc, cache / "cache.json")
    stdout, stderr = _ctrl_c(proc)
    os.close(writer)
    assert proc.returncode == 130, (stdout, stderr)
    assert [line for line in stderr.splitlines() if line.strip()] == [
        "error: interrupted before this command committed any work (what earlier runs committed is kept); "
        "re-run the same command"
    ]
