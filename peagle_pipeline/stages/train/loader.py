"""This rank's stream of training steps from a cache: rank sharding, micro-steps, worker processes, copy ahead.

- Steps: each optimizer step consumes `world_size * micro_steps` consecutive packed rows of the epoch's plan
  (`stages.train.packing.pack_epoch`); rank r, micro-step a of step s reads row `s * world * micro + r * micro + a`.
  So 2 ranks x 1 micro-step and 1 rank x 2 micro-steps see the same global batch. Rows left over at the end of an
  epoch are dropped.
- The data cursor `(epoch, step)` names the next step to run; it is all a resume needs.

Reading: a map-style torch Dataset over this rank's rows (DataLoader with `batch_size=None`, `num_workers` worker
processes); each process opens the cache lazily on first use and reads a row with
`stages.train.packed_batch.read_packed`. Never touches models; never writes.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from peagle_pipeline.core.heldout import DataSplit
from peagle_pipeline.errors import BadConfig
from peagle_pipeline.preemption import ignore_in_worker
from peagle_pipeline.stages.train.packed_batch import PackedBatch, into_shared_memory, read_packed
from peagle_pipeline.stages.train.packing import RowPlan, pack_epoch

__all__ = [
    "Cursor",
    "PackedRows",
    "LoaderSettings",
    "TrainLoader",
    "ahead_to_device",
]


@dataclass(frozen=True, order=True)
class Cursor:
    """The next optimizer step to run: `step`-th step of `epoch` (both 0-based)."""

    epoch: int = 0
    step: int = 0


class PackedRows(torch.utils.data.Dataset):
    """Map-style dataset keyed by (epoch, row): packed row `row` of that epoch's plan, read through `loader.cache`.

    One DataLoader spans every epoch (no worker restart at epoch boundaries); each process packs an epoch's plan
    itself (pure, from the sample table). The cache reader pickles without open file handles and reopens them
    lazily in each worker process.
    """

    def __init__(self, loader: TrainLoader) -> None:
        self.loader = loader

    def __getitem__(self, key: tuple[int, int]) -> PackedBatch:
        epoch, row = key
        lo = self.loader
        plan = lo.plan(epoch)[row]
        batch = read_packed(
            lo.cache, plan, epoch, row, lo.need_last_hidden, lo.skip_corrupt, lo.all_positions
        )
        return into_shared_memory(batch) if torch.utils.data.get_worker_info() is not None else batch


class _RowOrder(torch.utils.data.Sampler):
    """(epoch, row) keys of this rank from a cursor on, endlessly, in step order."""

    def __init__(self, loader: TrainLoader, cursor: Cursor) -> None:
        self.loader, self.cursor = loader, cursor

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for epoch, step in self.loader.steps_from(self.cursor):
            for row in self.loader.rows_of_step(step):
                yield epoch, row


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderSettings:
    """The training loader's own settings (built from the train section by `stages.train_data.loader_settings`)."""

    budget: int
    """Shifted tokens per packed row (`tokens_per_step`)."""
    seed: int
    """Shuffle seed."""
    num_workers: int
    """DataLoader worker processes (0 = read in the training process)."""
    need_last_hidden: bool
    """Read the stored last hidden state too (exact targets); see `read_packed`."""
    skip_corrupt: bool
    """Skip samples failing their checksum instead of stopping; see `read_packed`."""
    all_positions: bool = False
    """Loss on every position of the training rows, not only the cache's loss mask (`loss_positions: all`)."""
    pin_memory: bool = False
    """Rows in page-locked memory (set for a CUDA device: `ahead_to_device` then copies without blocking)."""


# The start of torch's DataLoader warning about more worker processes than usable CPUs.
_TOO_MANY_WORKERS = "This DataLoader will create"


class TrainLoader:
    """This rank's stream of optimizer steps: each item is the list of `micro_steps` PackedBatches of one step.

    Args:
        cache: the opened cache (`cache.reader.Cache`; pickled into workers, which reopen files lazily).
        split: from `split_samples`.
        settings: budget, seed, workers and what to read (`LoaderSettings`).
        rank, world_size: data-parallel position.
        micro_steps: packed rows per rank per optimizer step (gradient accumulation).
    """

    def __init__(
        self,
        cache: Any,
        split: DataSplit,
        settings: LoaderSettings,
        rank: int = 0,
        world_size: int = 1,
        micro_steps: int = 1,
    ) -> None:
        self.cache = cache
        self.split = split
        self.budget = budget = settings.budget
        self.seed = settings.seed
        self.rank = rank
        self.world_size = world_size
        self.micro_steps = micro_steps
        self.num_workers = settings.num_workers
        self.need_last_hidden = settings.need_last_hidden
        self.skip_corrupt = settings.skip_corrupt
        self.all_positions = settings.all_positions
        self.pin_memory = settings.pin_memory
        self._plans: dict[int, list[RowPlan]] = {}
        if len(split.train_ids) == 0:
            raise BadConfig("no training samples with supervised tokens in the cache")
        if self.steps_in_epoch(0) == 0:
            raise BadConfig(
                f"the training split packs into {len(self.plan(0))} row(s) of {budget} tokens, fewer than the "
                f"{world_size * micro_steps} one step needs: lower tokens_per_step or extract more samples"
            )

    def plan(self, epoch: int) -> list[RowPlan]:
        if epoch not in self._plans:  # keep two epochs: the sampler runs ahead across an epoch boundary
            self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
            self._plans[epoch] = pack_epoch(self.split, self.budget, self.seed, epoch)
        return self._plans[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.plan(epoch)) // (self.world_size * self.micro_steps)

    def rows_of_step(self, step: int) -> list[int]:
        """Packed-row indices this rank reads for `step` of an epoch."""
        base = step * self.world_size * self.micro_steps + self.rank * self.micro_steps
        return [base + a for a in range(self.micro_steps)]

    def steps_from(self, cursor: Cursor) -> Iterator[tuple[int, int]]:
        """(epoch, step) of every step from `cursor` on, endlessly."""
        epoch, step = cursor.epoch, cursor.step
        while True:
            for s in range(step, self.steps_in_epoch(epoch)):
                yield epoch, s
            epoch, step = epoch + 1, 0

    def iterate(self, cursor: Cursor) -> Generator[tuple[Cursor, list[PackedBatch]], None, None]:
        """Endless stream from `cursor`: (cursor after this step, this step's micro-batches), across epochs.

        Close the generator when done with it: that ends the loader's worker at once (it ignores SIGTERM)."""
        with warnings.catch_warnings():
            # torch warns twice, with its source line, when the workers outnumber the CPUs; `train` says it once
            warnings.filterwarnings("ignore", message=_TOO_MANY_WORKERS, category=UserWarning)
            loader = torch.utils.data.DataLoader(
                PackedRows(self),
                batch_size=None,
                sampler=_RowOrder(self, cursor),
                num_workers=self.num_workers,
                collate_fn=_identity,
                prefetch_factor=4 if self.num_workers else None,
                worker_init_fn=_ignore_sigint if self.num_workers else None,
                pin_memory=self.pin_memory,
            )
            it = iter(loader)
        for epoch, step in self.steps_from(cursor):
            micro = [next(it) for _ in range(self.micro_steps)]
            n = self.steps_in_epoch(epoch)
            yield (Cursor(epoch, step + 1) if step + 1 < n else Cursor(epoch + 1, 0)), micro


def ahead_to_device(
    stream: Generator[tuple[Cursor, list[PackedBatch]], None, None], device: torch.device
) -> Generator[tuple[Cursor, list[PackedBatch]], None, None]:
    """`TrainLoader.iterate`'s stream with each step's rows copied to a CUDA `device` one step ahead, on a side
    stream: while step i computes, step i+1's rows are in flight (the compute stream waits on an event before it
    reads them). Anything but CUDA gets the stream as it is. Closing this closes `stream`."""
    if device.type != "cuda":
        yield from stream
        return
    copier = torch.cuda.Stream(device)

    def start(item: tuple[Cursor, list[PackedBatch]]) -> tuple[Cursor, list[PackedBatch], torch.cuda.Event]:
        with torch.cuda.stream(copier):
            moved = [b.to_device(device) for b in item[1]]
            done = torch.cuda.Event()
            done.record(copier)
        return item[0], moved, done

    try:
        ahead = start(next(stream))
        while True:
            cursor, micro, done = ahead
            ahead = start(next(stream))
            compute = torch.cuda.current_stream(device)
            compute.wait_event(done)
            for (
                batch
            ) in micro:  # the copy stream allocated them; tell the allocator the compute stream uses them
                for t in batch._tensors().values():
                    if t.device.type == "cuda":
                        t.record_stream(compute)
            yield cursor, micro
    finally:
        stream.close()


def _identity(x: Any) -> Any:
    return x


def _ignore_sigint(worker_id: int) -> None:
    """Workers leave Ctrl-C and SIGTERM to the training process, which stops at a step boundary and ends them."""
    ignore_in_worker()
