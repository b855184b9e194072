"""CacheWriter: round trip, whole-shard commits, exact resume after an abandoned run, locks, mismatches, ENOSPC."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pandas as pd
import pytest
from cache_compare import assert_same_cache
from cache_fixtures import LENGTHS, write_cache
from fakes import fake_meta, fake_sample

from peagle_pipeline.cache import commit as commit_mod
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.commit import read_manifest
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.cache.writer import CacheWriter
from peagle_pipeline.errors import Busy, IncompatibleCache, OutOfSpace, ResumeMismatch

STORE = layout.store_name(0, 1)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"compress": "none"},
        {"compress": "auto", "has_last_hidden": True},
        {"hidden_dtype": "float32", "has_last_hidden": True},
        {"has_last_hidden": True, "shard_tokens": 32, "chunk_tokens": 32},
    ],
)
def test_round_trip_fast_and_zarr(tmp_path, over):
    meta = fake_meta(**over)
    samples = write_cache(tmp_path / "c", meta)
    cache = open_cache(tmp_path / "c")
    assert cache.samples["sample_id"].tolist() == list(range(len(LENGTHS)))
    assert cache.samples["offset"].tolist() == list(np.cumsum([0] + LENGTHS[:-1]))
    for rec, data in samples:
        fast, slow = cache.read_arrays(rec.sample_id), cache.read_arrays(rec.sample_id, fast=False)
        for k in fast:
            assert np.array_equal(fast[k], getattr(data, k)), k
            assert np.array_equal(slow[k], getattr(data, k)), k
    s = cache.read_sample(3)
    assert s.aux_hidden.shape == (90, 3, 8) and s.topk_ids.dtype.is_floating_point is False
    assert (s.last_hidden is not None) == meta.has_last_hidden
    assert verify_cache(cache) == []
    counts = np.zeros(meta.vocab_size, dtype=np.int64)
    for _, d in samples:
        counts += np.bincount(d.input_ids[d.loss_mask], minlength=meta.vocab_size)
    assert np.array_equal(cache.token_counts(), counts)


def test_commits_whole_shards_only(tmp_path, meta):
    root = tmp_path / "c"
    root.mkdir()
    w = CacheWriter(root, meta, 0, 1).open()
    rec, data = fake_sample(meta, 0, 50)
    w.add(0, rec, data)  # 50 < 64: nothing committed yet
    assert read_manifest(w.store_dir) is None
    rec, data = fake_sample(meta, 1, 100)
    w.add(1, rec, data)  # 150 tokens: 2 whole shards (128) committed, sample 1 straddles
    m = read_manifest(w.store_dir)
    assert m["committed_tokens"] == 128 and m["committed_samples"] == 1 and not m["complete"]
    assert [s["stop"] - s["start"] for s in m["shards"]] == [64, 64]
    w.close()
    m = read_manifest(w.store_dir)
    assert (
        m["complete"]
        and m["committed_tokens"] == 150
        and m["shards"][-1] == {**m["shards"][-1], "start": 128, "stop": 150}
    )


@pytest.mark.parametrize("stop_after", [1, 4, 7, 11])
def test_resume_after_abandoned_run_is_identical(tmp_path, stop_after):
    write_cache(tmp_path / "ref")
    write_cache(tmp_path / "res", stop_after=stop_after)  # dies: buffered tail lost, committed shards kept
    m = read_manifest(tmp_path / "res" / "stores" / STORE)
    committed = 0 if m is None else m["committed_samples"]
    assert committed <= stop_after
    write_cache(tmp_path / "res")  # the same run again: drops what is committed, recomputes the rest
    assert_same_cache(tmp_path / "ref", tmp_path / "res")


def test_resume_when_tables_are_ahead_of_manifest(tmp_path, meta):
    """Killed between the table writes and the manifest: the newer tables must not leak into the result."""
    write_cache(tmp_path / "ref")
    write_cache(tmp_path / "res", stop_after=6)
    store = tmp_path / "res" / "stores" / STORE
    counts = np.load(store / "token_counts.npy")
    np.save(store / "token_counts.npy", counts + 5)  # as if the next commit's tables were written
    samples = pd.read_parquet(store / "samples.parquet")
    pd.concat([samples, samples.tail(1)]).to_parquet(store / "samples.parquet", index=False)
    (store / "aux_hidden" / "c" / "9" / "0" / "0").parent.mkdir(parents=True, exist_ok=True)
    (store / "aux_hidden" / "c" / "9" / "0" / "0").write_bytes(b"garbage past the committed end")
    write_cache(tmp_path / "res")
    assert_same_cache(tmp_path / "ref", tmp_path / "res")
    assert verify_cache(open_cache(tmp_path / "res")) == []


def test_rerun_of_complete_store_is_noop(tmp_path, meta):
    write_cache(tmp_path / "c")
    w = CacheWriter(tmp_path / "c", meta, 0, 1).open()
    assert w.complete and w.committed_samples == len(LENGTHS)
    w.abort()


def test_second_writer_same_rank_is_busy(tmp_path, meta):
    root = tmp_path / "c"
    root.mkdir()
    w = CacheWriter(root, meta, 0, 1).open()
    with pytest.raises(Busy, match="already being written"):
        CacheWriter(root, meta, 0, 1).open()
    w.close()
    CacheWriter(root, meta, 0, 1).open().abort()  # free again after close


def test_resume_with_other_settings_refused(tmp_path, meta):
    write_cache(tmp_path / "c", stop_after=6)
    other = CacheMeta.from_dict({**meta.to_dict(), "topk": 8, "max_length": 64})
    with pytest.raises(ResumeMismatch, match="topk, max_length"):
        CacheWriter(tmp_path / "c", other, 0, 1).open()
    CacheWriter(tmp_path / "c", meta, 0, 1).open().abort()  # the lock was released by the refusal


def test_other_format_version_refused(tmp_path, meta):
    write_cache(tmp_path / "c")
    path = tmp_path / "c" / "stores" / STORE / "manifest.json"
    man = json.loads(path.read_text())
    path.write_text(json.dumps({**man, "format_version": 999}))
    with pytest.raises(IncompatibleCache, match="format version 999"):
        CacheWriter(tmp_path / "c", meta, 0, 1).open()


def test_changed_row_order_refused(tmp_path, meta):
    write_cache(tmp_path / "c", stop_after=8)
    w = CacheWriter(tmp_path / "c", meta, 0, 1).open()
    rec, data = fake_sample(meta, 77, LENGTHS[0])
    with pytest.raises(ResumeMismatch, match="order changed"):
        w.add(0, rec, data)
    w.abort()


def test_enospc_keeps_committed_data(tmp_path, meta, monkeypatch):
    root = tmp_path / "c"
    write_cache(root, stop_after=7)
    before = read_manifest(root / "stores" / STORE)
    real = commit_mod.atomic_write_bytes

    def full(path, data):
        if str(path).endswith("samples.parquet"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, data)

    monkeypatch.setattr(commit_mod, "atomic_write_bytes", full)
    with pytest.raises(OutOfSpace, match="re-run the same command"):
        write_cache(root)
    monkeypatch.setattr(commit_mod, "atomic_write_bytes", real)
    assert read_manifest(root / "stores" / STORE) == before  # the last commit is still the truth
    cache = open_cache(root, check=False)
    assert len(cache.samples) == before["committed_samples"]
    assert [p for p in verify_cache(cache) if "incomplete" not in p] == []
    write_cache(root)  # space is back: resume finishes
    write_cache(tmp_path / "ref")
    assert_same_cache(tmp_path / "ref", root)
