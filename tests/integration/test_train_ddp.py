"""Data parallel on CPU: `torchrun --nproc-per-node 2` (gloo) with one packed row per rank per step gives the same
weights and losses as one process that accumulates the same two rows per step (`train --grad-accum 2`, fp32), for
each drafting method.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_two_ranks_equal_one_process_with_grad_accum_2(tiny_cache: Path, tmp_path: Path, method: str) -> None:
    single = tmp_path / "single"
    argv = [
        "train",
        "--cache",
        str(tiny_cache),
        "--output",
        str(single),
        *_cli_flags(method),
        "--grad-accum",
        "2",
    ]
    assert main(argv) == 0  # one process, the command line's gradient accumulation
    cfg = resolve(
        TrainConfig, None, {"cache": str(tiny_cache), "output": str(single), "method": method, **FLAGS}
    )

    ddp = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PEAGLE_DEBUG", None)
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
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    a = load_file(str(single / "checkpoints" / "step-00000004" / "model.safetensors"))
    b = load_file(str(ddp / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert a.keys() == b.keys()
    from peagle_pipeline.cache.reader import open_cache

    init = draft.build_draft(open_cache(str(tiny_cache)), cfg)[0].state_dict()
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
