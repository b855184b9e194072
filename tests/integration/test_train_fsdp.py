"""Fully sharded data parallel on CPU: `torchrun --nproc-per-node 2 ... train --fsdp` (gloo, torch FSDP2) gives the
losses and weights of one process that accumulates the same two rows per step (`train --grad-accum 2`; fp32, 1e-5),
each rank holds about half of the optimizer state, and a run killed with SIGKILL after a checkpoint resumes to the
same weights; for each drafting method (EAGLE-3 in one segment per row: it runs rows whole).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_argv import descendants
from safetensors.torch import load_file

from peagle_pipeline.cli import main
from peagle_pipeline.stages.checkpoint import CheckpointManager
from peagle_pipeline.stages.train import metrics

pytestmark = pytest.mark.slow

STEPS = 20
FLAGS = {
    "depths": 4,
    "tokens_per_step": 120,
    "steps": STEPS,
    "eval_every": STEPS,
    "save_every": 10,
    "eval_samples": 4,
    "precision": "fp32",
    "log_every": 1,
    "warmup": 2,
    "lr": 2e-3,
    "num_workers": 0,
    "draft_vocab_size": 300,
    "sequence_partitions": 2,
    "device": "cpu",
    "export": False,
}


def _cli_flags(extra: dict[str, object]) -> list[str]:
    out = []
    for k, v in {**FLAGS, **extra}.items():
        if isinstance(v, bool):
            out.append(f"--{'' if v else 'no-'}{k.replace('_', '-')}")
        else:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _torchrun(cache: Path, run: Path, ckpt_sleep: str = "0", **extra: object) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PEAGLE_TEST_CKPT_SLEEP=ckpt_sleep)
    env.pop("PEAGLE_DEBUG", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["-m", "peagle_pipeline.cli", "train", "--cache", str(cache), "--output", str(run), "--fsdp"]
    return subprocess.Popen(
        argv + _cli_flags(extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


METHODS = {"peagle": {}, "eagle3": {"method": "eagle3", "sequence_partitions": 1}}


@pytest.mark.parametrize("method", list(METHODS))
def test_fsdp_two_ranks_equal_one_process_and_resume_after_kill(
    tiny_cache: Path, tmp_path: Path, method: str
) -> None:
    extra = METHODS[method]
    single = tmp_path / "single"
    argv = [
        "train",
        "--cache",
        str(tiny_cache),
        "--output",
        str(single),
        *_cli_flags({**extra, "grad_accum": 2}),
    ]
    assert main(argv) == 0  # one process, the command line's gradient accumulation

    run = tmp_path / "fsdp"
    proc = _torchrun(
        tiny_cache, run, ckpt_sleep="1.5", **extra
    )  # checkpoints slow to write: step 20's outlasts the kill
    ckpts = CheckpointManager(run, keep=2)
    deadline = time.monotonic() + 300
    while 10 not in ckpts.complete_steps() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in [proc.pid, *descendants(proc.pid)]:  # the whole job, as a lost node
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert 10 in ckpts.complete_steps(), err[-3000:]
    assert STEPS not in ckpts.complete_steps()  # killed before the end: the resume has work to do

    resumed = _torchrun(tiny_cache, run, resume=True, **extra)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]

    final = f"step-{STEPS:08d}"
    a = load_file(str(single / "checkpoints" / final / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / final / "model.safetensors"))
    assert a.keys() == b.keys()
    init = load_file(str(run / "checkpoints" / "step-00000010" / "model.safetensors"))
    assert not torch.allclose(init["fc.weight"], b["fc.weight"], atol=1e-4)  # the resume trained on
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    # the optimizer state written from the shards is the single-process one, index for index
    oa = torch.load(single / "checkpoints" / final / "optimizer.pt", weights_only=True)
    ob = torch.load(run / "checkpoints" / final / "optimizer.pt", weights_only=True)
    assert oa["state"].keys() == ob["state"].keys()
    for i, state in oa["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(value, ob["state"][i][name], rtol=1e-4, atol=1e-7, msg=f"{i} {name}")

    la = {r["step"]: r["loss"] for r in metrics.read_metrics(single) if r["kind"] == "train"}
    lb = {r["step"]: r["loss"] for r in metrics.read_metrics(run) if r["kind"] == "train"}
    assert sorted(la) == list(range(1, STEPS + 1)) and sorted(lb) == sorted(la)
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-5, abs=1e-6), step

    held = re.search(r"fsdp: optimizer state per rank ([\d.]+), ([\d.]+) MiB", err)
    assert held, err[-2000:]
    full = sum(v.numel() * v.element_size() for s in oa["state"].values() for v in s.values()) / 2**20
    for part in map(float, held.groups()):
        assert 0.4 * full < part < 0.6 * full, (held.groups(), full)
