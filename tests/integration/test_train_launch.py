"""`train --nproc-per-node 2`, the package's own launcher, with real processes (2 gloo ranks on CPU): one voice and
the documented exit codes where torchrun would add its ChildFailedError summary or SignalException and exit 1.

A Ctrl-C reaches the launcher alone (its ranks run in sessions of their own, as under torchrun), which passes it
on: every rank saves the step and the launcher exits 130; a rank killed with kill -9 is named in one line (exit
13); a refused resume is rank 0's one line and its exit code (5). The same training as torchrun's:
test_train_ddp.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from cli_argv import PEAGLE, last_train_step, rank_pid, small_train_flags, wait_until
from cli_run import run_cli

pytestmark = [pytest.mark.crash, pytest.mark.slow]

STEPS = 12
FLAGS = small_train_flags(
    depths=4, tokens_per_step=256, steps=STEPS, save_every=2, eval_every=1000, num_workers=0, eval_samples=4
)
TORCH_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d")  # a line of torch's own logging (torch elastic's warnings)


def _launch(cache: Path, out: Path, *extra: str) -> list[str]:
    return [
        *PEAGLE,
        "train",
        "--nproc-per-node",
        "2",
        "--cache",
        str(cache),
        "--output",
        str(out),
        *FLAGS,
        *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.pop("PEAGLE_DEBUG", None)
    return env


def _start(argv: list[str], **env: str) -> subprocess.Popen[str]:
    """The launcher as a terminal starts it: a process group of its own, which a Ctrl-C signals."""
    return subprocess.Popen(
        argv,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _one_voice(stderr: str) -> str:
    """The one error line of a failed run, after checking it is the only one and that nothing else speaks over
    it (no traceback, no torchrun summary, no torch logging)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    assert not [line for line in lines if TORCH_LOG.match(line)], stderr[-3000:]
    return errors[0]


def test_ctrl_c_stops_every_rank_with_a_checkpoint_and_exits_130(tiny_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(_launch(tiny_cache, out), PEAGLE_TEST_STEP_SLEEP="0.3")
    wait_until(proc, lambda: last_train_step(out) >= 3)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the launcher's group (the ranks have their own)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    line = _one_voice(stderr)
    assert line.startswith("error: interrupted at step "), line
    stopped = int(line.split("interrupted at step ")[1].split()[0])
    assert 3 <= stopped < STEPS and f"checkpoint step-{stopped} saved" in line and "--resume" in line, line
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:08d}"

    again = run_cli(_launch(tiny_cache, out, "--resume"), _env())
    assert again.code == 0, again.stderr[-3000:]
    assert f"resumed {out} at step {stopped} of {STEPS}" in again.stderr
    assert (out / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").is_file()


def test_a_rank_killed_is_one_line_exit_13_and_a_refused_resume_is_exit_5(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """kill -9 of rank 1 mid-run: the launcher names it in one line (rank 0 leaves the lost rank to it), with the
    last complete checkpoint and the resume command; then a resume with another packing budget is refused by
    rank 0's one line, with its own exit code."""
    out = tmp_path / "run"
    # one DataLoader worker, as by default: it outlives its killed rank (the launcher ends it)
    proc = _start(
        _launch(tiny_cache, out, "--steps", "400", "--num-workers", "1"), PEAGLE_TEST_STEP_SLEEP="0.3"
    )
    wait_until(proc, lambda: bool(list((out / "checkpoints").glob("step-*/meta.json"))))
    victim = rank_pid(proc.pid, 1)
    assert victim is not None, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 13, stderr[-3000:]
    steps = sorted(int(p.parent.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*/meta.json"))
    assert _one_voice(stderr) == (
        f"error: rank 1 of the 2 ranks of {out} was killed by SIGKILL: the last complete checkpoint is step "
        f"{steps[-1]}; re-run the same command with --resume to continue"
    )
    assert "SIGTERM" not in stderr  # the launcher waited for rank 0 to end by itself

    refused = run_cli(_launch(tiny_cache, out, "--resume", "--tokens-per-step", "200"), _env())
    assert refused.code == 5, refused.stderr[-3000:]
    line = _one_voice(refused.stderr)
    assert line.startswith(f"error: cannot resume {out}: settings differ") and "tokens_per_step" in line, line
