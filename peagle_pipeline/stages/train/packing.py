"""The packing plan of an epoch: the training samples, shuffled by (seed, epoch), packed greedily into rows.

Pure, from the split alone (no sample is opened): `pack_epoch` shuffles the training samples with a generator seeded
by (seed, epoch) and packs them greedily, in that order, into rows of at most `budget` shifted tokens (a sample of
T cached tokens gives S = T-1 shifted rows; a sample with S > budget is truncated to its first `budget` rows and
fills a row alone). `truncation` says what that cuts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from peagle_pipeline.core.heldout import DataSplit
from peagle_pipeline.core.seeds import mix_seed

__all__ = ["RowPlan", "truncation", "pack_rows", "pack_epoch"]


@dataclass(frozen=True)
class RowPlan:
    """One packed row: which samples, and how many shifted rows of each (after truncation)."""

    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def truncation(split: DataSplit, budget: int) -> tuple[int, int, int, int]:
    """What packing into rows of `budget` tokens cuts from the training samples.

    Returns (samples cut, shifted tokens dropped, shifted tokens in all, longest sample's shifted tokens).
    Example: budget 10, lengths [4, 12, 15] -> (2, 7, 31, 15).
    """
    lengths = split.train_lengths
    over = lengths[lengths > budget]
    longest = int(lengths.max()) if len(lengths) else 0
    return int(len(over)), int((over - budget).sum()), int(lengths.sum()), longest


def pack_rows(ids: np.ndarray, lengths: np.ndarray, budget: int, longest: int | None = None) -> list[RowPlan]:
    """Greedy packing in the given order: append to the open row while it fits, else start a new row. Each sample
    is cut to `longest` tokens (default `budget`); one longer than `budget` fills a row alone.

    Example: budget 10, lengths [4, 5, 3, 12] -> rows [4, 5], [3], [10 (truncated from 12)]; with longest 16 the
    last row is [12].
    """
    cut = budget if longest is None else longest
    rows: list[RowPlan] = []
    cur_ids: list[int] = []
    cur_len: list[int] = []
    used = 0
    for sid, n in zip(ids.tolist(), lengths.tolist(), strict=True):
        n = min(n, cut)
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
