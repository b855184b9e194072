"""Reads from an object store (fsspec `memory://`; tests/integration/test_object_store.py does the same against a
real S3 server): the batched ranged reads give the local fast path's arrays for every codec and range, and damage
in the remote bytes is reported as such."""

from __future__ import annotations

import shutil
import uuid

import numpy as np
import pytest
from cache_fixtures import write_cache
from fakes import fake_meta

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.errors import CorruptCache

fsspec = pytest.importorskip("fsspec")
STORE = layout.store_name(0, 1)


@pytest.fixture
def remote_copy(tmp_path):
    """Write a local cache (small shards: samples span them) and upload it; yields (local dir, memory:// URL)."""
    fs = fsspec.filesystem("memory")
    made = []

    def make(compress: str):
        local = tmp_path / f"c-{compress}"
        write_cache(local, fake_meta(shard_tokens=48, chunk_tokens=16, compress=compress))
        root = f"/remote-{uuid.uuid4().hex}"
        fs.put(str(local), root, recursive=True)
        made.append(root)
        return local, f"memory://{root}"

    yield make
    for root in made:
        fs.rm(root, recursive=True)
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("compress", ["zstd", "auto", "none"])
def test_remote_ranges_equal_local_fast_path(remote_copy, compress):
    local_dir, url = remote_copy(compress)
    local, remote = open_cache(local_dir), open_cache(url)
    lstore, rstore = local._stores[STORE], remote._stores[STORE]
    assert rstore.root.local is None and all(info.fast for info in rstore.info.values())
    names = list(local.specs)
    n = int(local.samples["length"].sum())
    rng = np.random.default_rng(1)
    for _ in range(40):
        a = int(rng.integers(0, n - 1))
        b = int(rng.integers(a + 1, min(n, a + 150) + 1))  # up to 150 rows: across shards of 48
        got = rstore.read_many(names, a, b)
        for name in names:
            want = lstore.read(name, a, b)
            assert got[name].dtype == want.dtype and np.array_equal(got[name], want), (name, a, b)
    for sid in local.samples["sample_id"]:
        r, l_ = remote.read_arrays(int(sid)), local.read_arrays(int(sid))
        assert r.keys() == l_.keys() and all(np.array_equal(r[k], l_[k]) for k in r)
    assert len(rstore._index) == len(lstore._index) > 0  # each shard's index read once, then kept


def test_remote_long_ranges_come_in_parts(remote_copy, monkeypatch):
    """A range longer than the part size is fetched as several ranged reads and joined in order."""
    from peagle_pipeline.cache import object_ranges

    local_dir, url = remote_copy("none")
    monkeypatch.setattr(object_ranges, "PART_BYTES", 100)
    local, remote = open_cache(local_dir), open_cache(url)
    for sid in local.samples["sample_id"]:
        r, l_ = remote.read_arrays(int(sid)), local.read_arrays(int(sid))
        assert all(np.array_equal(r[k], l_[k]) for k in r)


def _flip(url: str, rel: str, at: int) -> None:
    fs = fsspec.filesystem("memory")
    path = url.removeprefix("memory://") + "/" + rel
    blob = bytearray(fs.cat_file(path))
    blob[at] ^= 0xFF
    fs.pipe_file(path, bytes(blob))


SHARD1 = f"{layout.STORES_DIR}/{STORE}/aux_hidden/c/1/0/0"


def test_remote_damaged_chunk_is_corrupt_cache(remote_copy):
    _, url = remote_copy("zstd")
    _flip(url, SHARD1, 40)  # inside the shard's first chunk
    cache = open_cache(url)
    rows = cache.samples[
        (cache.samples["offset"] < 96) & (cache.samples["offset"] + cache.samples["length"] > 48)
    ]
    sid = int(rows["sample_id"].iloc[0])  # a sample with tokens in shard 1 (rows 48..95)
    with pytest.raises(CorruptCache, match=r"chunk \d+ of aux_hidden cannot be decoded"):
        cache.read_arrays(sid)


def test_remote_damaged_index_and_missing_shard(remote_copy):
    _, url = remote_copy("auto")
    fs = fsspec.filesystem("memory")
    _flip(url, SHARD1, len(fs.cat_file(url.removeprefix("memory://") + "/" + SHARD1)) - 6)
    cache = open_cache(url)
    with pytest.raises(CorruptCache, match="shard index of aux_hidden/c/1 is damaged"):
        cache._stores[STORE].read_many(["aux_hidden"], 50, 60)
    fs.rm(url.removeprefix("memory://") + "/" + SHARD1)
    fresh = open_cache(url)
    with pytest.raises(CorruptCache, match="missing"):
        fresh._stores[STORE].read_many(["input_ids", "aux_hidden"], 40, 60)
    assert (
        fresh._stores[STORE].read_many(["aux_hidden"], 0, 20)["aux_hidden"].shape[0] == 20
    )  # shard 0 intact
