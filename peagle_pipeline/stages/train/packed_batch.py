"""One packed row read from the cache: its samples read, shifted by one and concatenated (`PackedBatch`).

Shift per sample before packing: shifted row i = token x_{i+1}, aux g_i, target top-k P_{i+1}, weight m_{i+1} (and
last hidden h_{i+1} for exact targets). A sample that fails its check, a read the object store did not answer and
a worker without room in shared memory come back as facts on the row (raised as one line by the trainer, in the
main process). Never touches models; never writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from peagle_pipeline.errors import CorruptCache, StoreUnreachable
from peagle_pipeline.stages.train.packing import RowPlan

__all__ = ["PackedBatch", "shift_sample", "read_packed", "into_shared_memory"]


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
