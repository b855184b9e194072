"""Cache reader: open checks, fast path == zarr, fork/pickle safety, verify finds damage, fsspec URLs."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import pickle
import shutil

import numpy as np
import pytest
from cache_fixtures import LENGTHS, write_cache
from fakes import fake_meta, fake_sample

from peagle_pipeline.cache import layout
from peagle_pipeline.cache import reader as reader_mod
from peagle_pipeline.cache.reader import open_cache, prompt_length
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.cache.writer import CacheWriter
from peagle_pipeline.errors import BadInput, CorruptCache, IncompatibleCache

STORE = layout.store_name(0, 1)


def test_open_refuses_non_cache_and_incomplete(tmp_path):
    with pytest.raises(IncompatibleCache, match="not a peagle cache"):
        open_cache(tmp_path)
    write_cache(tmp_path / "c", stop_after=8)
    with pytest.raises(IncompatibleCache, match="incomplete"):
        open_cache(tmp_path / "c")
    partial = open_cache(tmp_path / "c", check=False)
    assert 0 < len(partial.samples) < 8
    meta = json.loads((tmp_path / "c" / "cache.json").read_text())
    (tmp_path / "c" / "cache.json").write_text(json.dumps({**meta, "format_version": 0}))
    with pytest.raises(IncompatibleCache, match="format 0"):
        open_cache(tmp_path / "c")


def test_missing_rank_store_refused_and_two_ranks_union(tmp_path):
    meta = fake_meta(world_size=2)
    write_cache(tmp_path / "c", meta, lengths=LENGTHS[:6], rank=0)
    with pytest.raises(IncompatibleCache, match="rank-00001-of-00002.zarr missing"):
        open_cache(tmp_path / "c")
    write_cache(tmp_path / "c", meta, lengths=LENGTHS[6:], rank=1)
    cache = open_cache(tmp_path / "c")
    assert sorted(cache.samples["sample_id"]) == sorted([0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11])
    assert set(cache.samples["store"]) == {layout.store_name(0, 2), layout.store_name(1, 2)}
    assert len(cache.rejects) == 2 and verify_cache(cache) == []
    assert cache.read_sample(3).input_ids.shape == (LENGTHS[7],)  # rank 1's second sample


@pytest.mark.parametrize("compress", ["zstd", "auto", "none"])
def test_fast_path_equals_zarr_on_random_ranges(tmp_path, compress):
    write_cache(tmp_path / "c", fake_meta(shard_tokens=48, chunk_tokens=16, compress=compress))
    cache = open_cache(tmp_path / "c")
    store = cache._stores[STORE]
    assert all(info.fast for info in store.info.values())  # every codec of every mode has a fast path
    if compress == "auto":
        assert store.info["topk_ids"].blosc and store.info["aux_hidden"].crc and store.info["input_ids"].zstd
    n = int(cache.samples["length"].sum())
    rng = np.random.default_rng(0)
    for _ in range(60):
        a = int(rng.integers(0, n - 1))
        b = int(rng.integers(a + 1, min(n, a + 150) + 1))
        for name in cache.specs:
            assert np.array_equal(store.read(name, a, b), store.read(name, a, b, fast=False)), (name, a, b)


def test_unknown_sample_is_bad_input(tmp_path):
    write_cache(tmp_path / "c")
    with pytest.raises(BadInput, match="sample 12345"):
        open_cache(tmp_path / "c").read_sample(12345)


def _read_in_child(cache, sid, q):
    q.put(cache.read_arrays(sid)["aux_hidden"].tobytes())


def test_reads_after_fork_and_pickle(tmp_path):
    write_cache(tmp_path / "c")
    cache = open_cache(tmp_path / "c")
    want = cache.read_arrays(7)["aux_hidden"].tobytes()  # opens handles in the parent first
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_read_in_child, args=(cache, 7, q))
    p.start()
    got = q.get(timeout=30)
    p.join(30)
    assert got == want and p.exitcode == 0
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.read_arrays(7)["aux_hidden"].tobytes() == want


def test_verify_names_store_and_samples_of_a_damaged_shard(tmp_path):
    write_cache(tmp_path / "c")
    shard = tmp_path / "c" / "stores" / STORE / "aux_hidden" / "c" / "1" / "0" / "0"
    blob = bytearray(shard.read_bytes())
    blob[40] ^= 0xFF  # inside the first chunk's compressed bytes
    shard.write_bytes(bytes(blob))
    cache = open_cache(tmp_path / "c")
    problems = verify_cache(cache)
    assert problems and all(STORE in p for p in problems)
    assert any("aux_hidden shard 1" in p and "samples 3" in p for p in problems), problems
    with pytest.raises(CorruptCache):  # the zstd frame checksum / size check catches it on the fast path
        cache.read_arrays(3)


def test_prompt_keys_of_damaged_token_rows_are_none(tmp_path):
    """A damaged input_ids chunk costs the keys of the samples in it (None), not the whole read: training then
    reports those samples, or skips them with skip_corrupt, as before."""
    write_cache(tmp_path / "c")
    ids = open_cache(tmp_path / "c").samples["sample_id"].to_numpy()
    clean = open_cache(tmp_path / "c").prompt_keys(ids)
    shard = tmp_path / "c" / "stores" / STORE / "input_ids" / "c" / "1"  # a shard file per 1-D shard
    blob = bytearray(shard.read_bytes())
    blob[20] ^= 0xFF  # inside the first chunk's compressed bytes
    shard.write_bytes(bytes(blob))
    cache = open_cache(tmp_path / "c")
    damaged = []
    for sid in ids.tolist():
        try:
            cache.read_arrays(sid)
        except CorruptCache:
            damaged.append(sid)
    assert damaged and len(damaged) < len(ids)
    keys = cache.prompt_keys(ids)
    assert [k for k, sid in zip(keys, ids.tolist(), strict=True) if sid in damaged] == [None] * len(damaged)
    assert [k for k, sid in zip(keys, ids.tolist(), strict=True) if sid not in damaged] == [
        k for k, sid in zip(clean, ids.tolist(), strict=True) if sid not in damaged
    ]


def test_verify_detects_table_changes(tmp_path):
    write_cache(tmp_path / "c")
    path = tmp_path / "c" / "stores" / STORE / "token_counts.npy"
    counts = np.load(path)
    counts[3] += 1
    np.save(path, counts)
    problems = verify_cache(open_cache(tmp_path / "c"))
    assert any("token_counts.npy does not match its manifest" in p for p in problems)
    assert any("disagrees with the supervised tokens" in p for p in problems)


def test_summary_and_counts(tmp_path):
    write_cache(tmp_path / "c")
    text = open_cache(tmp_path / "c").summary()
    assert f"samples: {len(LENGTHS)}, tokens: {sum(LENGTHS)}" in text
    assert "empty conversation" in text and "bytes/token" in text


def test_open_through_fsspec_memory_url(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    write_cache(tmp_path / "c")
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "c"), "/mc", recursive=True)
    remote = open_cache("memory://mc")
    local = open_cache(tmp_path / "c")
    assert len(remote.samples) == len(LENGTHS)
    for sid in (0, 3, 7):
        r, l_ = remote.read_arrays(sid), local.read_arrays(sid)
        for k in r:
            assert np.array_equal(r[k], l_[k])
    assert np.array_equal(remote.token_counts(), local.token_counts())
    shutil.rmtree(tmp_path / "c")


# ---- verify checks what the manifest commits; tables and shards beyond it are not damage ----
def _in_progress(root):
    """A store as a writer leaves it between writing its tables and its manifest (or a copy taken then):
    shards and tables of a later commit, the manifest of an earlier one."""
    write_cache(root, stop_after=6)
    manifest = root / "stores" / STORE / layout.MANIFEST
    early = manifest.read_bytes()
    write_cache(root, stop_after=10)
    assert json.loads(manifest.read_text())["committed_samples"] > json.loads(early)["committed_samples"]
    manifest.write_bytes(early)
    return json.loads(early)


def _add_target(root):
    """A target/ as extract writes it: config.json, a tokenizer file, pieces.safetensors with the three pieces."""
    import json

    import torch
    from safetensors.torch import save_file

    from peagle_pipeline.cache import layout

    target = root / layout.TARGET_DIR
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (target / "tokenizer.json").write_text("{}")
    save_file({k: torch.zeros(2, 2) for k in layout.PIECE_KEYS}, str(target / layout.PIECES_FILE))


def test_verify_of_a_cache_being_written_reports_only_that_it_is_incomplete(tmp_path, capsys):
    from peagle_pipeline.cli import main

    early = _in_progress(tmp_path / "c")
    assert 0 < early["committed_samples"] < 10
    cache = open_cache(tmp_path / "c", check=False)
    assert len(cache.samples) == early["committed_samples"]
    assert verify_cache(cache) == [
        f"{STORE}: incomplete ({early['committed_samples']} samples committed); re-run extract to finish it"
    ]
    _add_target(tmp_path / "c")  # (extract writes target/ before any store; this cache has only a writer's)
    assert main(["verify", str(tmp_path / "c")]) == 3  # incomplete (IncompatibleCache), not corrupt (4)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {tmp_path / 'c'} is incomplete (1 store(s) still being written or never finished); "
        "what is committed verified ok"
    ]


def test_verify_still_finds_damage_in_the_committed_part_of_a_store_being_written(tmp_path, capsys):
    from peagle_pipeline.cli import main

    _in_progress(tmp_path / "c")
    counts = tmp_path / "c" / "stores" / STORE / "token_counts.npy"
    np.save(counts, np.zeros_like(np.load(counts)))  # fewer than the committed samples hold: damage
    shard = tmp_path / "c" / "stores" / STORE / "aux_hidden" / "c" / "0" / "0" / "0"
    blob = bytearray(shard.read_bytes())
    blob[40] ^= 0xFF
    shard.write_bytes(bytes(blob))
    problems = verify_cache(open_cache(tmp_path / "c", check=False))
    assert any("aux_hidden shard 0" in p for p in problems), problems
    assert any("token_counts.npy counts fewer" in p for p in problems), problems
    assert main(["verify", str(tmp_path / "c")]) == 4
    assert "problem(s) found" in capsys.readouterr().err


def test_inspect_of_a_rejected_sample_gives_the_reject_reason(tmp_path, capsys):
    """`inspect --sample ID` of a rejected row said only "not in cache"."""
    from peagle_pipeline.cli import main

    write_cache(tmp_path / "c")  # row 1000 (fake.jsonl row 7) is rejected as an empty conversation
    assert main(["inspect", str(tmp_path / "c"), "--sample", "1000"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: sample 1000 was rejected at extraction (fake.jsonl row 7): empty conversation"
    ]
    assert main(["inspect", str(tmp_path / "c"), "--sample", "999"]) == 2
    assert "sample 999 is not in cache" in capsys.readouterr().err


def test_prompt_length_is_the_tokens_before_the_first_supervised_one():
    assert prompt_length(np.array([0, 0, 0, 1, 1, 0, 1], bool)) == 3
    assert prompt_length(np.array([1, 1], bool)) == 0
    assert prompt_length(np.zeros(4, bool)) == 0


def test_prompt_keys_are_equal_exactly_for_samples_with_one_prompt(tmp_path, monkeypatch):
    """Cache.prompt_keys: one digest per prompt (the ids before the first supervised token), the same for samples
    that share it whatever follows, None without a prompt; a small read window gives the same keys."""
    rows = [  # (input_ids, loss_mask)
        ([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]),  # prompt 5 6 7
        ([5, 6, 7, 1, 2, 3], [0, 0, 0, 1, 0, 1]),  # the same prompt, another reply
        ([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]),  # prompt 5 6
        ([4, 6, 7, 8, 9], [0, 0, 0, 1, 1]),  # prompt 4 6 7
        ([5, 6, 7, 8], [1, 1, 1, 1]),  # no prompt
        ([5, 6, 7, 8], [0, 0, 0, 0]),  # nothing supervised
        ([5, 6, 7, 8, 9, 9, 9], [0, 0, 0, 0, 0, 0, 1]),  # a longer prompt that starts with 5 6 7
    ]
    meta = fake_meta()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / layout.CACHE_META).write_text(json.dumps(meta.to_dict()))
    w = CacheWriter(tmp_path / "c", meta, 0, 1).open()
    for i, (ids, mask) in enumerate(rows):
        rec, data = fake_sample(meta, i, len(ids))
        w.add(
            i,
            rec,
            dataclasses.replace(data, input_ids=np.array(ids, np.int32), loss_mask=np.array(mask, bool)),
        )
    w.close()
    cache = open_cache(tmp_path / "c")
    keys = cache.prompt_keys(np.array([6, 0, 1, 2, 3, 4, 5]))
    assert keys[1] == keys[2] and keys[1] is not None
    assert keys[5] is None and keys[6] is None
    assert len({keys[0], keys[1], keys[3], keys[4]}) == 4  # the longer prompt, 5 6 7 and 5 6, 4 6 7
    monkeypatch.setattr(reader_mod, "_KEY_WINDOW_TOKENS", 6)  # a window per sample or two
    assert cache.prompt_keys(np.array([6, 0, 1, 2, 3, 4, 5])) == keys
    with pytest.raises(BadInput, match="sample 99"):
        cache.prompt_keys(np.array([99]))
