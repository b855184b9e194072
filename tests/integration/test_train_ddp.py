"""Data parallel on CPU: `torchrun --nproc-per-node 2` (gloo) with one packed row per rank per step gives the same
weights and losses as one process that accumulates the same two rows per step (`train --grad-accum 2`, fp32), for
each drafting method; so does `train --nproc-per-node 2`, the package's own launcher (its exit codes and signals:
test_train_launch.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_argv import rank_pid
from cli_run import run_cli
from safetensors.torch import load_file

from peagle_pipeline.cli import main
from peagle_pipeline.config import TrainConfig, resolve
from peagle_pipeline.stages.train import draft, metrics

pytestmark = pytest.mark.slow

FLAGS = {
    "depths": 4,
    "tokens_per_step": 200,
    "steps": 4,
    "eval_every": 4,
    "save_every": 4,
    "eval_samples": 4,
    "precision": "fp32",
    "log_every": 1,
    "warmup": 1,
    "lr": 2e-3,
    "num_workers": 0,
    "draft_vocab_size": 300,
    "export": False,
}


def _cli_flags(method: str) -> list[str]:
    out = ["--method", method]
    for k, v in FLAGS.items():
        if isinstance(v, bool):
            out.append(f"--{'' if v else 'no-'}{k.replace('_', '-')}")
        else:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _single(cache: Path, out: Path, method: str) -> TrainConfig:
    """One process accumulating two rows per step (the command line's --grad-accum 2); returns its settings."""
    argv = ["train", "--cache", str(cache), "--output", str(out), *_cli_flags(method), "--grad-accum", "2"]
    assert main(argv) == 0
    return resolve(TrainConfig, None, {"cache": str(cache), "output": str(out), "method": method, **FLAGS})


def _assert_same_training(single: Path, ddp: Path, cache: Path, cfg: TrainConfig) -> None:
    """Two ranks trained as one process: the same weights, losses and held-out figures; rank 1 wrote nothing."""
    a = load_file(str(single / "checkpoints" / "step-00000004" / "model.safetensors"))
    b = load_file(str(ddp / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert a.keys() == b.keys()
    from peagle_pipeline.cache.reader import open_cache

    init = draft.build_draft(open_cache(str(cache)), cfg)[0].state_dict()
    assert not torch.allclose(init["fc.weight"], a["fc.weight"], atol=1e-4)  # training moved the weights
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    la = [r["loss"] for r in metrics.read_metrics(single) if r["kind"] == "train"]
    lb = [r["loss"] for r in metrics.read_metrics(ddp) if r["kind"] == "train"]
    assert len(la) == 4 and la == pytest.approx(lb, rel=1e-5)
    ea = [r for r in metrics.read_metrics(single) if r["kind"] == "eval"][-1]
    eb = [r for r in metrics.read_metrics(ddp) if r["kind"] == "eval"][-1]
    assert ea["acceptance"] == pytest.approx(eb["acceptance"], rel=1e-5)
    # rank 1 wrote nothing of its own: one metrics file, one set of checkpoints
    assert len(list(ddp.glob("**/metrics.jsonl"))) == 1


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PEAGLE_DEBUG", None)
    return env


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_two_ranks_equal_one_process_with_grad_accum_2(tiny_cache: Path, tmp_path: Path, method: str) -> None:
    single = tmp_path / "single"
    cfg = _single(tiny_cache, single, method)
    ddp = tmp_path / "ddp"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "peagle_pipeline.cli",
            "train",
            "--cache",
            str(tiny_cache),
            "--output",
            str(ddp),
            *_cli_flags(method),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_training(single, ddp, tiny_cache, cfg)


def test_nproc_per_node_2_trains_as_torchrun_does(tiny_cache: Path, tmp_path: Path) -> None:
    """`train --nproc-per-node 2`, the package's own launcher (no torchrun): two ranks with torchrun's environment,
    the same training as one process with --grad-accum 2; rank 0 alone speaks."""
    single = tmp_path / "single"
    cfg = _single(tiny_cache, single, "peagle")
    launched = tmp_path / "launched"
    argv = ["train", "--nproc-per-node", "2", "--cache", str(tiny_cache), "--output", str(launched)]
    done = run_cli([*argv, *_cli_flags("peagle")], _env())
    assert done.code == 0, done.stderr[-3000:]
    _assert_same_training(single, launched, tiny_cache, cfg)
    assert done.stderr.count("global batch: ") == 1 and "x 2 rank(s)" in done.stderr, done.stderr[-3000:]


def _torchrun(cache: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "peagle_pipeline.cli", "train", "--cache", str(cache), "--output", str(out), *_cli_flags("peagle"), *extra,
    ]  # fmt: skip


def test_a_rank_killed_is_one_line_from_rank_0_and_a_refusal_is_said_once(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """torchrun, 2 ranks: kill -9 of rank 1 mid-run. Rank 0 says, in one line and without a traceback, which rank
    died, the last complete checkpoint and the resume command, and promises no checkpoint it cannot write; then
    the same command without --resume is refused once (rank 0's line), with the exit code torchrun replaces."""
    import signal
    import time

    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PEAGLE_TEST_STEP_SLEEP="0.4")
    env.pop("PEAGLE_DEBUG", None)
    argv = _torchrun(tiny_cache, out, "--steps", "400", "--save-every", "2")
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list((out / "checkpoints").glob("step-*/meta.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    victim = rank_pid(launcher.pid, 1)
    assert victim is not None, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=240)
    ours = [line for line in err.splitlines() if line.startswith(("error:", "[rank"))]
    assert launcher.returncode != 0 and len(ours) == 1, err[-3000:]
    steps = sorted(int(p.parent.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*/meta.json"))
    assert ours[0].startswith(f"error: rank 1 of the 2 ranks of {out} died"), ours
    assert f"the last complete checkpoint is step {steps[-1]}" in ours[0] and "--resume" in ours[0]
    assert "(exit 13; torchrun itself exits 1" in ours[0]
    assert "saving a checkpoint\n" not in err  # (only "... if every rank is still running")

    env.pop("PEAGLE_TEST_STEP_SLEEP")
    again = subprocess.run(_torchrun(tiny_cache, out), env=env, capture_output=True, text=True, timeout=300)
    ours = [line for line in again.stderr.splitlines() if line.startswith(("error:", "[rank"))]
    assert again.returncode == 1 and len(ours) == 1, again.stderr[-3000:]
    assert (
        "already holds a training run: add --resume" in ours[0]
        and "(exit 6; torchrun itself exits 1" in ours[0]
    )
