"""Write small caches from fake samples (shared by cache unit tests and benchmarks of the writer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakes import fake_meta, fake_sample  # noqa: E402

from peagle_pipeline.cache import layout  # noqa: E402
from peagle_pipeline.cache.writer import CacheWriter  # noqa: E402

LENGTHS = [5, 40, 17, 90, 3, 64, 33, 128, 1, 70, 12, 20]


def write_cache(
    root: Path, meta=None, lengths=LENGTHS, rank: int = 0, stop_after: int | None = None, close: bool = True
) -> list:
    """Write samples with ids rank, rank+world, ... ; optionally stop (no close) after `stop_after` samples."""
    meta = meta or fake_meta()
    root.mkdir(parents=True, exist_ok=True)
    if not (root / layout.CACHE_META).exists():
        (root / layout.CACHE_META).write_text(json.dumps(meta.to_dict()))
    samples = [fake_sample(meta, rank + i * meta.world_size, n) for i, n in enumerate(lengths)]
    w = CacheWriter(root, meta, rank, meta.world_size).open()
    try:
        for o, (rec, data) in enumerate(samples):
            if stop_after is not None and o >= stop_after:
                w.abort()
                return samples
            w.add(o, rec, data)
            if o == 2:
                w.add_reject(1000 + rank, "fake.jsonl", 7, "empty conversation")
    except BaseException:
        w.abort()
        raise
    if close:
        w.close()
    else:
        w.abort()
    return samples
