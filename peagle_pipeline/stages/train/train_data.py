"""What a training run reads: the loader's settings, the training split and the held-out set.

Composition over the cache reader and `core.heldout` (no model, no writes): `loader_settings` picks the loader's own
settings out of the train section, `training_data` opens the cache (with `extra_cache`, all of them as one
`CacheUnion`) and splits it (`core.heldout.split_samples`), `held_out_set` names the samples (of the training cache
or of `eval_cache`) behind the held-out figures, `without_held_out_prompts` keeps their prompts out of training,
`hold_out` does both for the trainer, and `check_truncation` says what `tokens_per_step` cuts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import numpy as np

from peagle_pipeline.cache.union import CacheUnion, cache_differences
from peagle_pipeline.config import TrainConfig
from peagle_pipeline.core.heldout import DataSplit, split_samples
from peagle_pipeline.errors import BadConfig, IncompatibleCache
from peagle_pipeline.stages.train.draft import require_last_hidden
from peagle_pipeline.stages.train.loader import LoaderSettings
from peagle_pipeline.stages.train.packing import truncation

__all__ = [
    "loader_settings",
    "training_data",
    "separate_eval_cache",
    "held_out_set",
    "without_held_out_prompts",
    "hold_out",
    "check_truncation",
]

log = logging.getLogger(__name__)


def loader_settings(cfg: TrainConfig) -> LoaderSettings:
    """The training loader's own settings from the train section."""
    return LoaderSettings(
        budget=cfg.tokens_per_step,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        need_last_hidden=cfg.target == "exact",
        skip_corrupt=cfg.skip_corrupt,
        all_positions=cfg.loss_positions == "all",
    )


def training_data(cfg: TrainConfig) -> tuple[Any, DataSplit]:
    """The opened training cache and its split.

    `eval_samples` of `cache` are held out (none when `eval_cache` is another cache). With `extra_cache`, the
    cache returned is a `CacheUnion` of `cache` and those caches, and every usable sample of the extra caches joins
    the training split: the held-out samples, and so the held-out figures, are the same as without them.

    Raises:
        IncompatibleCache: an extra cache holds another target's states or arrays that do not stack (names them).
    """
    from peagle_pipeline.cache.reader import open_cache

    primary = open_cache(cfg.cache, check=True)
    split = split_samples(primary.samples, 0 if separate_eval_cache(cfg) else cfg.eval_samples, cfg.seed)
    if not cfg.extra_cache:
        return primary, split
    caches = [primary]
    for path in cfg.extra_cache:
        other = open_cache(path, check=True)
        differ = cache_differences(primary, other, stacking=True)
        if differ:
            raise IncompatibleCache(
                f"extra_cache {path} cannot train beside cache {cfg.cache}: {', '.join(differ)} differ"
            )
        caches.append(other)
    union = CacheUnion(caches)
    extra = split_samples(union.samples[union.samples["sample_id"] >= union.starts[1]], 0, cfg.seed)
    return union, DataSplit(
        train_ids=np.concatenate([split.train_ids, extra.train_ids]),
        train_lengths=np.concatenate([split.train_lengths, extra.train_lengths]),
        eval_ids=split.eval_ids,
        eval_lengths=split.eval_lengths,
        skipped_unsupervised=split.skipped_unsupervised + extra.skipped_unsupervised,
    )


def separate_eval_cache(cfg: TrainConfig) -> bool:
    """True when the held-out figures come from another cache than the training one (`eval_cache`)."""
    return bool(cfg.eval_cache) and os.path.realpath(cfg.eval_cache) != os.path.realpath(cfg.cache)


def held_out_set(cache: Any, split: DataSplit, cfg: TrainConfig) -> tuple[Any, DataSplit]:
    """The cache and split whose `eval_ids` the held-out figures use: the training cache's own split, or with
    `eval_cache` that cache's seeded held-out subset (the same subset its own training runs hold out).

    Raises:
        IncompatibleCache: the eval cache holds another target's states (names the settings).
    """
    from peagle_pipeline.cache.reader import open_cache

    if not separate_eval_cache(cfg):
        return cache, split
    other = open_cache(cfg.eval_cache, check=True)
    require_last_hidden(cfg.target, other.meta, f"eval_cache {cfg.eval_cache}")
    differ = cache_differences(cache, other, stacking=False)
    if differ:
        raise IncompatibleCache(
            f"eval_cache {cfg.eval_cache} was extracted from another target than cache {cfg.cache} "
            f"({', '.join(differ)} differ)"
        )
    return other, split_samples(other.samples, cfg.eval_samples, cfg.seed)


def without_held_out_prompts(cache: Any, split: DataSplit, eval_cache: Any, eval_set: DataSplit) -> DataSplit:
    """`split` less the training samples whose prompt is also a held-out sample's prompt (`Cache.prompt_keys`),
    counted in `shared_prompts`.

    Several replies generated for one prompt, or one conversation in two caches (`extra_cache`, `eval_cache`),
    would otherwise put the held-out sample's prompt, and often its very reply, into training, and the held-out
    figures would read high. `eval_cache`/`eval_set` are where the held-out samples come from (`held_out_set`).
    """
    if not len(eval_set.eval_ids) or not len(split.train_ids):
        return split
    held = {key for key in eval_cache.prompt_keys(eval_set.eval_ids) if key is not None}
    keep = np.array([key not in held for key in cache.prompt_keys(split.train_ids)], dtype=bool)
    if keep.all():
        return split
    return dataclasses.replace(
        split,
        train_ids=split.train_ids[keep],
        train_lengths=split.train_lengths[keep],
        shared_prompts=split.shared_prompts + int((~keep).sum()),
    )


def hold_out(cache: Any, split: DataSplit, cfg: TrainConfig) -> tuple[DataSplit, Any, DataSplit]:
    """The run's held-out samples set apart: (`split` less the samples sharing a held-out prompt, the cache and
    the split whose `eval_ids` give the held-out figures); see `held_out_set` and `without_held_out_prompts`.

    With the training cache's own held-out samples, the eval split is the training split returned.

    Raises:
        IncompatibleCache: the eval cache holds another target's states (names the settings).
    """
    eval_cache, eval_set = held_out_set(cache, split, cfg)
    split = without_held_out_prompts(cache, split, eval_cache, eval_set)
    return split, eval_cache, split if eval_cache is cache else eval_set


def check_truncation(split: Any, budget: int) -> None:
    """Samples longer than tokens_per_step are cut to their first `budget` tokens: say so, and refuse a budget
    that would drop half or more of the training tokens (`--tokens-per-step 1` trains on one token per sample).

    Raises:
        BadConfig: half or more of the training tokens would be dropped.
    """
    cut, dropped, total, longest = truncation(split, budget)
    if not cut:
        return
    share = dropped / max(total, 1)
    what = (
        f"tokens_per_step {budget} is shorter than {cut} of {len(split.train_ids)} training samples (longest "
        f"{longest} shifted tokens): {share:.0%} of the training tokens would never be trained on"
    )
    if share >= 0.5:
        raise BadConfig(
            f"{what}; use --tokens-per-step {longest} or more (--sequence-partitions cuts memory)"
        )
    log.warning("%s; use --tokens-per-step %d or more to train on whole samples", what, longest)
