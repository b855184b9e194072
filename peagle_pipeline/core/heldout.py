"""The held-out split of a cache: which samples train and which give the held-out figures.

Pure, from the cache's per-sample table only (no sample is opened): `split_samples` drops the samples with no
supervised token (counted), then holds out `eval_samples` of the rest, a random subset fixed by the seed. The
trainer evaluates on this split (`stages.train.train_data`) and `evaluate heldout:RUN_DIR` draws its prompts from
it (`stages.evaluate.prompts`), so both see the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from peagle_pipeline.core.seeds import mix_seed

__all__ = ["DataSplit", "split_samples"]


@dataclass(frozen=True)
class DataSplit:
    """Training and held-out samples (ids and shifted lengths S = T-1), plus what was skipped."""

    train_ids: np.ndarray  # int64 [n_train]
    train_lengths: np.ndarray  # int64 [n_train] shifted rows S
    eval_ids: np.ndarray  # int64 [n_eval]
    eval_lengths: np.ndarray  # int64 [n_eval]
    skipped_unsupervised: int
    shared_prompts: int = 0  # training samples left out for sharing a held-out sample's prompt


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
