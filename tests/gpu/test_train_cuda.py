"""bf16 training on CUDA: steps through DDP over one process (NCCL and gloo, world size 1) give the same losses as
the bare model and learn; the real `train` command picks bf16 by itself on CUDA and writes a finite run."""

from __future__ import annotations

import copy
import json
import socket

import pytest
import torch

from bench.bench_dtype import train_step
from bench.bench_gpu import cuda_setup
from peagle_pipeline.hardware import resolve_compute_dtype


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(setup: tuple, steps: int) -> list[float]:
    params = [p for p in setup[0].parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out.append(train_step(setup, "bf16", 4, 1, zero_grad=False))
        opt.step()
    return out


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_bf16_steps_through_ddp_of_one_process(backend):
    assert resolve_compute_dtype("auto", "cuda:0") == "bf16" or torch.cuda.get_device_capability()[0] < 8
    setup = cuda_setup(2048, 2, 4)
    plain_model = copy.deepcopy(setup[0])
    torch.distributed.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(setup[0], device_ids=[0])
        losses = _losses((ddp, *setup[1:]), 8)
    finally:
        torch.distributed.destroy_process_group()
    plain = _losses((plain_model, *setup[1:]), 8)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses == pytest.approx(
        plain, rel=2e-2
    )  # bf16 kernels may reorder sums; one rank averages nothing
    assert losses[-1] < losses[0]  # it learns the fixed batch


@pytest.mark.slow
def test_train_command_on_cuda_picks_bf16(tiny_cache_cuda, tmp_path, capsys):
    from peagle_pipeline.cli import main

    run = tmp_path / "run"
    argv = [
        "train",
        "--cache",
        str(tiny_cache_cuda),
        "--output",
        str(run),
        "--device",
        "cuda",
        "--steps",
        "6",
    ]
    argv += ["--tokens-per-step", "512", "--depths", "4", "--eval-samples", "4", "--eval-every", "3"]
    argv += ["--log-every", "1", "--num-workers", "0", "--draft-vocab-size", "300", "--warmup", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "compute dtype bf16 on cuda" in err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(train) == 6 and all(torch.isfinite(torch.tensor(train)))
    assert (run / "export" / "model.safetensors").is_file()
