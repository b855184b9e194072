"""This process's place in the data-parallel group: torchrun environment, process group, tiny all-reduces.

Only `stages.train.stage.run()` creates one (STYLE: process groups only in a stage's run()).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from peagle_pipeline.errors import BadConfig, RankLost
from peagle_pipeline.runtime import rank_world_from_env

__all__ = ["Dist", "resolve_device", "lost_peer", "rank_lost"]


@dataclass
class Dist:
    """This process's place in the data-parallel group (world 1 = no process group)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def setup(cls, device: str) -> Dist:
        """Read RANK/WORLD_SIZE/LOCAL_RANK (torchrun); init gloo (CPU) or NCCL (CUDA) when world > 1."""
        rank, world = rank_world_from_env(None, None)
        local = int(os.environ.get("LOCAL_RANK", rank))
        dev = resolve_device(device, local, world, torch.cuda.is_available())
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        owns = False
        if world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
            owns = True
        return cls(rank=rank, world=world, local_rank=local, device=dev, owns_group=owns)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small CPU tensor over ranks, in place (through the device for NCCL, which has no CPU tensors)."""
        if self.world > 1:
            on_dev = t.to(self.device)
            torch.distributed.all_reduce(on_dev)
            t.copy_(on_dev.cpu())
        return t

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def teardown(self) -> None:
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def resolve_device(device: str, local_rank: int, world: int, cuda_available: bool) -> torch.device:
    """The training device of this process, always with an index for CUDA (`torch.cuda.set_device` refuses a bare
    "cuda"): auto = cuda:LOCAL_RANK when CUDA is there, else cpu; "cuda" = cuda:LOCAL_RANK under torchrun (world > 1),
    else cuda:0 (the first visible GPU); "cuda:N" and "cpu" as given.

    Raises:
        BadConfig: a CUDA device asked for where CUDA is not available.
    """
    auto = device == "auto"
    if auto:
        device = "cuda" if cuda_available else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not cuda_available:
        raise BadConfig(f"device {device} requested but CUDA is not available")
    if dev.index is None:
        dev = torch.device("cuda", local_rank if world > 1 or auto else 0)
    return dev


def lost_peer(err: BaseException) -> bool:
    """Whether `err`, raised by a collective, means another rank's process is gone (gloo: the connection closed;
    NCCL: the communicator aborted), not a fault of this rank."""
    text = str(err)
    return type(err).__name__ == "DistBackendError" or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "remote worker crash")
    )


def rank_lost(output: str, who: str, world: int, how: str, command: str) -> RankLost:
    """The one line of a run that lost a rank: `who` ("rank 1") and `how` it ended ("was killed by SIGKILL"), the
    last complete checkpoint, and how the `command` ("command", "torchrun command") continues the run."""
    from peagle_pipeline.stages.checkpoint import CheckpointManager
    from peagle_pipeline.stages.run_layout import TRAIN_YAML

    steps = CheckpointManager(output, keep=1).complete_steps()
    if steps:
        kept = f"the last complete checkpoint is step {steps[-1]}; re-run the same {command} with --resume to continue"
    elif (Path(output) / TRAIN_YAML).is_file():
        kept = (
            f"no checkpoint was saved yet; re-run the same {command} with --resume to continue from the start"
        )
    else:  # it had not started training: a resume would find nothing to continue
        kept = f"nothing was saved yet; re-run the same {command} to start"
    return RankLost(f"{who} of the {world} ranks of {output} {how}: {kept}")
