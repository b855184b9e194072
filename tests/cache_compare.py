"""Compare two caches array by array and table by table (used by the resume and crash tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.commit import read_manifest
from peagle_pipeline.cache.reader import open_cache

TABLES = (layout.SAMPLES_TABLE, layout.REJECTS_TABLE, layout.TOKEN_COUNTS)


def assert_same_cache(a: Path, b: Path) -> None:
    """Both caches complete and bit-identical: every array of every sample, every table file, every checksum."""
    ca, cb = open_cache(a), open_cache(b)
    pd.testing.assert_frame_equal(ca.samples, cb.samples)
    pd.testing.assert_frame_equal(ca.rejects, cb.rejects)
    assert np.array_equal(ca.token_counts(), cb.token_counts())
    for sid in ca.samples["sample_id"]:
        ra, rb = ca.read_arrays(int(sid)), cb.read_arrays(int(sid))
        for k in ra:
            assert np.array_equal(ra[k], rb[k]), (int(sid), k)
    for store in ca.manifests:
        for name in TABLES:
            pa, pb = Path(a) / layout.STORES_DIR / store / name, Path(b) / layout.STORES_DIR / store / name
            assert pa.read_bytes() == pb.read_bytes(), (store, name)
        ma, mb = (
            read_manifest(Path(a) / layout.STORES_DIR / store),
            read_manifest(Path(b) / layout.STORES_DIR / store),
        )
        assert ma["shards"] == mb["shards"] and ma["committed_tokens"] == mb["committed_tokens"]
        assert ma["tables"] == mb["tables"]
