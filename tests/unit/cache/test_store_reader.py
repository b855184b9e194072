"""cache.store_reader: the pread fast path equals Zarr's own decoding for every codec, across chunk and shard
boundaries; damaged or mismatched array metadata is refused; handles are per process."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from cache_fixtures import LENGTHS, write_cache
from fakes import fake_meta

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.store_reader import StoreReader, StoreRoot
from peagle_pipeline.errors import CorruptCache

STORE = layout.store_name(0, 1)
TOTAL = sum(LENGTHS)


def _reader(root, meta) -> StoreReader:
    store = StoreRoot(root)
    manifest = json.loads(store.read_bytes(f"{layout.STORES_DIR}/{STORE}/{layout.MANIFEST}"))
    return StoreReader(store, STORE, manifest, layout.array_specs(meta))


@pytest.mark.parametrize("compress", ["auto", "zstd", "none"])
def test_fast_path_equals_zarr_for_every_codec(tmp_path, compress):
    meta = fake_meta(compress=compress, has_last_hidden=True)
    write_cache(tmp_path / "c", meta=meta)
    reader = _reader(tmp_path / "c", meta)
    # chunk 16, shard 64: within a chunk, across chunks, across a shard boundary, the whole store
    for start, stop in ((0, 5), (3, 40), (60, 70), (127, 129), (0, TOTAL)):
        for array, (dtype, inner) in layout.array_specs(meta).items():
            fast = reader.read(array, start, stop)
            slow = reader.read(array, start, stop, fast=False)
            assert fast.dtype == np.dtype(dtype) and fast.shape == (stop - start, *inner)
            assert fast.tobytes() == slow.tobytes(), (array, start, stop)
    reader.prefetch(0, TOTAL)  # a hint only: nothing to assert but that it does not fail
    reader.close()


def test_root_paths_and_sizes(tmp_path):
    write_cache(tmp_path / "c")
    for root in (StoreRoot(tmp_path / "c"), StoreRoot(f"file://{tmp_path / 'c'}")):
        assert root.local == tmp_path / "c" and root.fs is None
        assert root.exists(layout.CACHE_META) and not root.exists("nope")
        assert root.read_bytes(layout.CACHE_META) == (tmp_path / "c" / layout.CACHE_META).read_bytes()
        store = tmp_path / "c" / layout.STORES_DIR / STORE
        assert root.size(f"{layout.STORES_DIR}/{STORE}") == sum(
            f.stat().st_size for f in store.rglob("*") if f.is_file()
        )


def test_damaged_or_mismatched_array_metadata_is_refused(tmp_path):
    meta = fake_meta()
    write_cache(tmp_path / "c", meta=meta)
    zjson = tmp_path / "c" / layout.STORES_DIR / STORE / "topk_ids" / "zarr.json"
    good = zjson.read_text()
    zjson.write_text("{")
    with pytest.raises(CorruptCache, match=r"topk_ids/zarr.json is damaged \(JSONDecodeError\)"):
        _reader(tmp_path / "c", meta)
    zjson.write_text(good)
    other = fake_meta(topk=5)  # the cache says k=4
    with pytest.raises(CorruptCache, match="topk_ids/zarr.json disagrees with the cache metadata"):
        _reader(tmp_path / "c", other)


def test_damaged_chunk_bytes_raise_corrupt_cache(tmp_path):
    meta = fake_meta()
    write_cache(tmp_path / "c", meta=meta)
    shard = tmp_path / "c" / layout.STORES_DIR / STORE / "input_ids" / "c" / "0"
    blob = bytearray(shard.read_bytes())
    blob[20] ^= 0xFF  # inside the first zstd frame
    shard.write_bytes(bytes(blob))
    reader = _reader(tmp_path / "c", meta)
    with pytest.raises(CorruptCache, match=f"store {STORE}: chunk 0 of input_ids cannot be decoded"):
        reader.read("input_ids", 0, 8)


def test_pickled_reader_reopens_its_files(tmp_path):
    meta = fake_meta()
    write_cache(tmp_path / "c", meta=meta)
    reader = _reader(tmp_path / "c", meta)
    want = reader.read("aux_hidden", 10, 50)
    assert reader._fds  # the fast path opened shard files
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._fds == {} and clone._pid == -1
    assert clone.read("aux_hidden", 10, 50).tobytes() == want.tobytes()
