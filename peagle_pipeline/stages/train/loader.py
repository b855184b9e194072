"""Training data from a cache: held-out split, per-epoch shuffle, shift, greedy packing, rank sharding, workers.

Plan (pure, from the per-sample table only; no sample is opened at start-up):
- `split_samples`: drop samples with no supervised token (counted), then hold out `eval_samples` fixed by seed.
- `pack_epoch`: shuffle the training samples with a generator seeded by (seed, epoch) and pack them greedily, in
  that order, into rows of at most `budget` shifted tokens (a sample of T cached tokens gives S = T-1 shifted
  rows; a sample with S > budget is truncated to its first `budget` rows and fills a row alone).
- Steps: each optimizer step consumes `world_size * micro_steps` consecutive packed rows of the epoch; rank r,
  micro-step a of step s reads row `s * world * micro + r * micro + a`. So 2 ranks x 1 micro-step and
  1 rank x 2 micro-steps see the same global batch. Rows left over at the end of an epoch are dropped.
- The data cursor `(epoch, step)` names the next step to run; it is all a resume needs.

Reading: a map-style torch Dataset over this rank's rows (DataLoader with `batch_size=None`, `num_workers` worker
processes); each process opens the cache lazily on first use. Shift per sample before packing: shifted row i =
token x_{i+1}, aux g_i, target top-k P_{i+1}, weight m_{i+1} (and last hidden h_{i+1} for exact targets).
Never touches models; never writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from peagle_pipeline.errors import BadConfig, CorruptCache, StoreUnreachable
from peagle_pipeline.preemption import ignore_in_worker

__all__ = [
    "RowPlan",
    "DataSplit",
    "Cursor",
    "PackedBatch",
    "mix_seed",
    "split_samples",
    "truncation",
    "pack_rows",
    "pack_epoch",
    "shift_sample",
    "into_shared_memory",
    "PackedRows",
    "LoaderSettings",
    "TrainLoader",
    "ahead_to_device",
]

log = logging.getLogger(__name__)


def mix_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of parts (independent streams for shuffle, split, COD rows, init)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class RowPlan:
    """One packed row: which samples, and how many shifted rows of each (after truncation)."""

    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class DataSplit:
    """Training and held-out samples (ids and shifted lengths S = T-1), plus what was skipped."""

    train_ids: np.ndarray  # int64 [n_train]
    train_lengths: np.ndarray  # int64 [n_train] shifted rows S
    eval_ids: np.ndarray  # int64 [n_eval]
    eval_lengths: np.ndarray  # int64 [n_eval]
    skipped_unsupervised: int
    shared_prompts: int = 0  # training samples left out for sharing a held-out sample's prompt


@dataclass(frozen=True, order=True)
class Cursor:
    """The next optimizer step to run: `step`-th step of `epoch` (both 0-based)."""

    epoch: int = 0
    step: int = 0


@dataclass
class PackedBatch:
    """One packed row in shifted coordinates, L = sum(doc_lengths) rows (no padding).

    Attributes:
        input_ids: LongTensor [L] token x_{i+1} of each shifted row.
        aux_hidden: [L, n_aux * H] aux states g_i (bf16 or fp32, as stored).
        topk_ids: LongTensor [L, k] target top-k ids of P_{i+1}.
        topk_logprobs: FloatTensor [L, k] their log-probs.
        weight: BoolTensor [L] m_{i+1}: rows that carry loss.
        last_hidden: [L, H] pre-norm last hidden h_{i+1} (exact targets) or None.
        doc_lengths: shifted rows per packed sample.
        sample_ids: cache sample ids, in packing order.
        epoch, row: where this row sits in the epoch plan (seeds the row's COD generator).
        corrupt: (sample id, message) of samples dropped because their data failed its check.
        unreachable: the message of a read the object store did not answer (the row stops there; never skipped).
        no_shared_memory: the message of a loader worker that found no room in shared memory for the row (the
            row comes back empty; see `into_shared_memory`).
    """

    input_ids: torch.Tensor
    aux_hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    weight: torch.Tensor
    last_hidden: torch.Tensor | None
    doc_lengths: list[int]
    sample_ids: list[int]
    epoch: int
    row: int
    corrupt: list[tuple[int, str]] = field(default_factory=list)
    unreachable: str | None = None
    no_shared_memory: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def pin_memory(self) -> PackedBatch:
        """The row in page-locked memory (the DataLoader's pin thread calls this when `pin_memory` is set)."""
        pinned: dict[str, Any] = {k: t.pin_memory() for k, t in self._tensors().items()}
        return dataclasses.replace(self, **pinned)

    def to_device(self, device: torch.device) -> PackedBatch:
        """The row's states on `device` (copied without blocking from pinned memory); `weight`, which the COD
        layout reads on the host, stays where it is."""
        moved: dict[str, Any] = {
            k: t.to(device, non_blocking=True) for k, t in self._tensors().items() if k != "weight"
        }
        return dataclasses.replace(self, **moved)

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("input_ids", "aux_hidden", "topk_ids", "topk_logprobs", "weight", "last_hidden")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


def split_samples(samples: Any, eval_samples: int, seed: int) -> DataSplit:
    """Split the cache's sample table (pandas, `layout.SAMPLE_COLUMNS`) into training and held-out ids.

    Samples with no supervised token or fewer than 2 tokens are skipped (counted). The held-out set is a
    seeded random subset (at most half the usable samples), independent of the epoch shuffles.
    """
    ids = samples["sample_id"].to_numpy(dtype=np.int64)
    lengths = samples["length"].to_numpy(dtype=np.int64) - 1
    usable = (samples["num_supervised"].to_numpy() > 0) & (lengths > 0)
    order = np.argsort(ids[usable], kind="stable")
    ids, lengths = ids[usable][order], lengths[usable][order]
    n_eval = min(eval_samples, len(ids) // 2)
    g = torch.Generator().manual_seed(mix_seed("eval-split", seed))
    perm = torch.randperm(len(ids), generator=g).numpy()
    held = np.sort(perm[:n_eval])
    keep = np.ones(len(ids), dtype=bool)
    keep[held] = False
    return DataSplit(
        train_ids=ids[keep],
        train_lengths=lengths[keep],
        eval_ids=ids[held],
        eval_lengths=lengths[held],
        skipped_unsupervised=int((~usable).sum()),
    )


def truncation(split: DataSplit, budget: int) -> tuple[int, int, int, int]:
    """What packing into rows of `budget` tokens cuts from the training samples.

    Returns (samples cut, shifted tokens dropped, shifted tokens in all, longest sample's shifted tokens).
    Example: budget 10, lengths [4, 12, 15] -> (2, 7, 31, 15).
    """
    lengths = split.train_lengths
    over = lengths[lengths > budget]
    longest = int(lengths.max()) if len(lengths) else 0
    return int(len(over)), int((over - budget).sum()), int(lengths.sum()), longest


def pack_rows(ids: np.ndarray, lengths: np.ndarray, budget: int) -> list[RowPlan]:
    """Greedy packing in the given order: append to the open row while it fits, else start a new row.

    Example: budget 10, lengths [4, 5, 3, 12] -> rows [4, 5], [3], [10 (truncated from 12)].
    """
    rows: list[RowPlan] = []
    cur_ids: list[int] = []
    cur_len: list[int] = []
    used = 0
    for sid, n in zip(ids.tolist(), lengths.tolist(), strict=True):
        n = min(n, budget)
        if used + n > budget and cur_ids:
            rows.append(RowPlan(tuple(cur_ids), tuple(cur_len)))
            cur_ids, cur_len, used = [], [], 0
        cur_ids.append(sid)
        cur_len.append(n)
        used += n
    if cur_ids:
        rows.append(RowPlan(tuple(cur_ids), tuple(cur_len)))
    return rows


def pack_epoch(split: DataSplit, budget: int, seed: int, epoch: int) -> list[RowPlan]:
    """This epoch's packed rows: a (seed, epoch)-seeded permutation of the training samples, packed greedily."""
    g = torch.Generator().manual_seed(mix_seed("shuffle", seed, epoch))
    perm = torch.randperm(len(split.train_ids), generator=g).numpy()
    return pack_rows(split.train_ids[perm], split.train_lengths[perm], budget)


def shift_sample(
    sample: Any, n: int, need_last_hidden: bool, all_positions: bool = False
) -> dict[str, torch.Tensor | None]:
    """Shift one cached sample (unshifted rows 0..T-1) by one and keep its first `n` <= T-1 shifted rows.

    `weight` is the sample's loss mask, or True everywhere when `all_positions` (loss_positions: all).

    Returns a dict of input_ids [n], aux_hidden [n, n_aux*H], topk_ids [n, k], topk_logprobs [n, k],
    weight [n], last_hidden [n, H] | None.
    """
    aux = sample.aux_hidden[:n]
    return {
        "input_ids": sample.input_ids[1 : n + 1].long(),
        "aux_hidden": aux.reshape(n, -1),
        "topk_ids": sample.topk_ids[1 : n + 1].long(),
        "topk_logprobs": sample.topk_logprobs[1 : n + 1].float(),
        "weight": torch.ones(n, dtype=torch.bool) if all_positions else sample.loss_mask[1 : n + 1].bool(),
        "last_hidden": sample.last_hidden[1 : n + 1] if need_last_hidden else None,
    }


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


def read_packed(
    cache: Any,
    plan: RowPlan,
    epoch: int,
    row: int,
    need_last_hidden: bool,
    skip_corrupt: bool,
    all_positions: bool = False,
) -> PackedBatch:
    """Read and shift every sample of `plan` and concatenate them into one PackedBatch (`all_positions`: see
    `shift_sample`).

    A sample whose read raises CorruptCache is dropped and listed in `corrupt` (the trainer raises unless
    skip_corrupt); the message is kept so the error is raised in the main process with one line. A read the
    object store did not answer (StoreUnreachable) ends the row and is kept in `unreachable` the same way.
    """
    parts: list[dict[str, torch.Tensor | None]] = []
    lengths: list[int] = []
    ids: list[int] = []
    corrupt: list[tuple[int, str]] = []
    unreachable = None
    for sid, n in zip(plan.sample_ids, plan.lengths, strict=True):
        try:
            sample = cache.read_sample(sid)
        except StoreUnreachable as err:
            unreachable = str(err)
            break
        except CorruptCache as err:
            corrupt.append((sid, str(err)))
            if not skip_corrupt:
                break
            continue
        parts.append(shift_sample(sample, n, need_last_hidden, all_positions))
        lengths.append(n)
        ids.append(sid)
    if not parts:  # every sample corrupt (or none read): an empty row (the trainer skips it)
        return _empty_row(epoch, row, corrupt=corrupt, unreachable=unreachable)

    def cat(key: str) -> torch.Tensor:
        return torch.cat([p[key] for p in parts])  # type: ignore[misc]

    return PackedBatch(
        input_ids=cat("input_ids"),
        aux_hidden=cat("aux_hidden"),
        topk_ids=cat("topk_ids"),
        topk_logprobs=cat("topk_logprobs"),
        weight=cat("weight"),
        last_hidden=cat("last_hidden") if need_last_hidden else None,
        doc_lengths=lengths,
        sample_ids=ids,
        epoch=epoch,
        row=row,
        corrupt=corrupt,
        unreachable=unreachable,
    )


def _empty_row(epoch: int, row: int, **why: Any) -> PackedBatch:
    """A row with no tokens; `why` says what emptied it (`corrupt`, `unreachable` or `no_shared_memory`)."""
    return PackedBatch(
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 0),
        torch.zeros(0, 0, dtype=torch.long),
        torch.zeros(0, 0),
        torch.zeros(0, dtype=torch.bool),
        None,
        [],
        [],
        epoch,
        row,
        **why,
    )


def into_shared_memory(batch: PackedBatch) -> PackedBatch:
    """Move a worker's row into shared memory before the DataLoader sends it, so a full /dev/shm is reported.

    Left to the DataLoader, the move happens while its queue pickles the row in a background thread: there a full
    /dev/shm (a container's default 64 MB holds less than one bf16 row of 8,192 tokens of a 2,048-wide target) is printed as a
    traceback, the row is dropped and the trainer waits for it forever. Here the failure comes back as an empty
    row whose `no_shared_memory` the trainer raises as one line. Tensors already in shared memory are sent as they
    are (no second copy).
    """
    tensors = [
        batch.input_ids,
        batch.aux_hidden,
        batch.topk_ids,
        batch.topk_logprobs,
        batch.weight,
        *([] if batch.last_hidden is None else [batch.last_hidden]),
    ]
    try:
        for t in tensors:
            t.share_memory_()
    except RuntimeError as err:
        if "shared memory" not in str(err):
            raise
        mb = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        return _empty_row(
            batch.epoch,
            batch.row,
            no_shared_memory=f"the data loader's worker found no room in shared memory (/dev/shm) for a row of "
            f"{batch.num_tokens} tokens ({mb:.1f} MB; several are in flight at once): give /dev/shm more "
            f"room (docker run --shm-size=...), lower tokens_per_step, or set num_workers: 0",
        )
    return batch


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
