"""kill -9 a real `peagle-pipeline train` subprocess (tiny cache, fp32, CPU) mid-run and mid-checkpoint-write;
`--resume` must finish with weights, optimizer state and per-step losses identical to an uninterrupted run (mid-run:
for each drafting method).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_argv import small_train_flags, train_argv, wait_for_group_exit
from cli_run import run_cli
from safetensors.torch import load_file

from peagle_pipeline.stages.train import metrics

pytestmark = [pytest.mark.crash, pytest.mark.slow]

STEPS = 30
FLAGS = small_train_flags(depths=4, tokens_per_step=200, steps=STEPS, eval_every=10, num_workers=1)


def _cmd(cache: Path, out: Path, *extra: str) -> list[str]:
    return train_argv(cache, out, *FLAGS, *extra)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.pop("PEAGLE_DEBUG", None)
    return env


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = run_cli(cmd, env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _kill_when(cmd: list[str], env: dict[str, str], ready, timeout: float = 240) -> None:
    """Start `cmd`, poll `ready()` every 10 ms, kill -9 the process group as soon as it is true."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, "training finished before it could be killed"
            assert time.monotonic() < deadline, "timed out waiting for the kill point"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its DataLoader worker
    finally:
        proc.wait()
        wait_for_group_exit(proc.pid)  # the worker too: it holds the run's lock until it is gone
    assert proc.returncode == -signal.SIGKILL


def _steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    return (
        sorted(int(p.name[5:]) for p in root.glob("step-*") if p.is_dir() and not p.suffix)
        if root.exists()
        else []
    )


def _assert_same_run(a: Path, b: Path) -> None:
    final = f"step-{STEPS:08d}"
    wa = load_file(str(a / "checkpoints" / final / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / final / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    oa = torch.load(a / "checkpoints" / final / "optimizer.pt", weights_only=True)
    ob = torch.load(b / "checkpoints" / final / "optimizer.pt", weights_only=True)
    for i, state in oa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, ob["state"][i][name]), (i, name)
    la = [(r["step"], r["loss"]) for r in metrics.read_metrics(a) if r["kind"] == "train"]
    lb = [(r["step"], r["loss"]) for r in metrics.read_metrics(b) if r["kind"] == "train"]
    assert la == lb and len(la) == STEPS


@pytest.fixture(scope="module")
def reference(tiny_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    _run(_cmd(tiny_cache, out), _env())
    return out


@pytest.fixture(scope="module")
def eagle3_reference(tiny_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref-eagle3") / "run"
    _run(_cmd(tiny_cache, out, "--method", "eagle3"), _env())
    return out


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_kill_mid_run_then_resume_is_exact(
    tiny_cache: Path, method: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    reference = request.getfixturevalue("eagle3_reference" if method == "eagle3" else "reference")
    out = tmp_path / "run"
    extra = ("--method", method)
    _kill_when(_cmd(tiny_cache, out, *extra), _env(), lambda: len(_steps(out)) >= 2 and _steps(out)[-1] >= 9)
    killed_at = _steps(out)[-1]
    assert killed_at < STEPS
    _run(_cmd(tiny_cache, out, *extra, "--resume"), _env())
    _assert_same_run(reference, out)


def test_kill_during_checkpoint_write_then_resume_is_exact(
    tiny_cache: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    root = out / "checkpoints"
    env = _env(PEAGLE_TEST_CKPT_SLEEP="0.5")  # a checkpoint write now takes >= 1 s: kill inside it
    _kill_when(
        _cmd(tiny_cache, out),
        env,
        lambda: (
            _steps(out)
            and root.exists()
            and any(p.name.endswith(".tmp") and p.name >= "step-00000006" for p in root.iterdir())
        ),
    )
    assert list(root.glob("*.tmp")), "the kill happened outside a checkpoint write"
    assert all((root / f"step-{s:08d}" / "meta.json").is_file() for s in _steps(out))
    _run(_cmd(tiny_cache, out, "--resume"), _env())
    assert not list(root.glob("*.tmp"))
    _assert_same_run(reference, out)
