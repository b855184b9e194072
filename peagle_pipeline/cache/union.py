"""Several opened caches of one target read as one (`train --extra-cache`).

The first cache is the primary: its sample ids stay as they are, and the target's files, the tokenizer and the
settings come from it. Every further cache's ids are shifted past the ids before it, so ids never collide. Token
counts are the sums over all caches (the draft vocabulary and the mask-token rule see all the data). Reading only:
nothing here writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from peagle_pipeline.cache.reader import Cache, SampleArrays

if TYPE_CHECKING:
    from peagle_pipeline.core.vocab import TokenizerFacts

__all__ = ["CacheUnion", "cache_differences"]

# What a further cache must share with the primary beyond the target (`CacheMeta.target_differences`): samples of
# different caches are packed into one row, so their arrays must stack.
_SAME_ARRAYS = ("topk", "hidden_dtype", "has_last_hidden")


def cache_differences(primary: Any, other: Any, stacking: bool) -> list[str]:
    """What keeps `other` from serving beside `primary` (opened caches), as setting names (empty: nothing).

    Always: another target (config, tokenizer, aux layers, sizes, or the target weights stored in `target/`). With
    `stacking`, also arrays that cannot share one packed row (top-k, hidden dtype, a last hidden state).
    """
    differ = primary.meta.target_differences(other.meta)
    if stacking:
        a, b = primary.meta.to_dict(), other.meta.to_dict()
        differ += [k for k in _SAME_ARRAYS if a.get(k) != b.get(k)]
    if not differ:
        import torch

        mine, theirs = primary.target_pieces(), other.target_pieces()
        differ = [f"{k} weights" for k in mine if k not in theirs or not torch.equal(mine[k], theirs[k])]
    return differ


class CacheUnion:
    """The samples of `caches` under one id space; the first cache is the primary (see the module docstring).

    Attributes:
        samples: the sample table (`layout.SAMPLE_COLUMNS`) of every cache, ids shifted by `starts`.
        starts: int64 [n_caches] the first id of each cache's range (0 for the primary).
    """

    def __init__(self, caches: list[Cache]) -> None:
        import pandas as pd

        self.caches = caches
        primary = caches[0]
        self.meta = primary.meta
        self.path = primary.path
        starts, frames, start = [], [], 0
        for cache in caches:
            starts.append(start)
            table = cache.samples.copy()
            table["sample_id"] = table["sample_id"].astype(np.int64) + start
            frames.append(table)
            ids = cache.samples["sample_id"]
            start += int(ids.max()) + 1 if len(ids) else 0
        self.starts = np.array(starts, dtype=np.int64)
        self.samples: pd.DataFrame = pd.concat(frames, ignore_index=True)

    @property
    def primary(self) -> Cache:
        return self.caches[0]

    def __len__(self) -> int:
        return sum(len(c) for c in self.caches)

    def part_of(self, sample_id: int) -> tuple[Cache, int]:
        """The cache holding a union id, and the id within that cache."""
        i = int(np.searchsorted(self.starts, sample_id, side="right")) - 1
        return self.caches[i], sample_id - int(self.starts[i])

    def read_sample(self, sample_id: int) -> SampleArrays:
        cache, local = self.part_of(sample_id)
        return cache.read_sample(local)

    def prompt_keys(self, sample_ids: np.ndarray) -> list[bytes | None]:
        """`Cache.prompt_keys` of union ids (one read pass per cache)."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        part = np.searchsorted(self.starts, ids, side="right") - 1
        keys: list[bytes | None] = [None] * len(ids)
        for i, cache in enumerate(self.caches):
            where = np.flatnonzero(part == i)
            for k, key in zip(where, cache.prompt_keys(ids[where] - self.starts[i]), strict=True):
                keys[int(k)] = key
        return keys

    def token_counts(self) -> np.ndarray:
        return np.sum([c.token_counts() for c in self.caches], axis=0)

    def all_token_counts(self) -> np.ndarray:
        return np.sum([c.all_token_counts() for c in self.caches], axis=0)

    # The target's files and the tokenizer are the primary's (every cache was checked to hold the same target).
    def target_config(self) -> dict[str, Any]:
        return self.primary.target_config()

    def target_pieces(self) -> dict[str, Any]:
        return self.primary.target_pieces()

    def target_layer(self) -> Any:
        return self.primary.target_layer()

    def tokenizer(self) -> Any:
        return self.primary.tokenizer()

    def tokenizer_facts(self) -> TokenizerFacts | None:
        return self.primary.tokenizer_facts()

    def close(self) -> None:
        for cache in self.caches:
            cache.close()
