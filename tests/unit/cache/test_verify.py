"""cache.verify: each check of a store, on small real caches (tests/cache_fixtures.py) damaged one way at a time.

The end-to-end cases (a damaged shard byte, changed tables, a store being written) are in test_reader.py.
"""

from __future__ import annotations

import json
import shutil

from cache_fixtures import LENGTHS, write_cache

from peagle_pipeline.cache import layout, verify
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import Finding, verify_cache

STORE = layout.store_name(0, 1)


def _opened(tmp_path):
    write_cache(tmp_path / "c")
    cache = open_cache(tmp_path / "c")
    samples = cache.samples[cache.samples["store"] == STORE].reset_index(drop=True)
    return cache, dict(cache.manifests[STORE]), samples


def test_a_sound_cache_has_no_findings(tmp_path):
    cache, _, _ = _opened(tmp_path)
    assert verify_cache(cache) == []


def test_samples_table_checks(tmp_path):
    cache, manifest, samples = _opened(tmp_path)
    assert verify._check_samples(cache, STORE, manifest, samples, {}) == []

    gap = samples.copy()
    gap.loc[2, "offset"] += 1
    assert any(
        f"offsets not contiguous at samples [{gap.loc[2, 'sample_id']}" in p
        for p in verify._check_samples(cache, STORE, manifest, gap, {})
    )
    long = samples.copy()
    long.loc[0, "length"] = cache.meta.max_length + 1
    found = verify._check_samples(cache, STORE, manifest, long, {})
    assert any("have lengths outside 1..max_length" in p for p in found), found
    first = int(samples.loc[0, "sample_id"])
    assert f"{STORE}: sample {first} also in other.zarr" in verify._check_samples(
        cache, STORE, manifest, samples, {first: "other.zarr"}
    )
    moved = {**manifest, "rank": 1}
    assert any(
        "does not belong to rank 1" in p for p in verify._check_samples(cache, STORE, moved, samples, {})
    )
    more = {**manifest, "committed_samples": len(samples) + 1}
    assert f"{STORE}: samples table holds {len(samples)} of the {len(samples) + 1} committed samples" in (
        verify._check_samples(cache, STORE, more, samples, {})
    )


def test_a_shard_checksum_mismatch_names_the_samples_it_affects(tmp_path):
    cache, manifest, samples = _opened(tmp_path)
    group = cache._root.zarr_group(f"{layout.STORES_DIR}/{STORE}")
    found, data = verify._check_arrays(cache, STORE, manifest, samples, group)
    assert found == [] and len(data["input_ids"]) == sum(LENGTHS)
    shards = [dict(s, checksums=dict(s["checksums"])) for s in manifest["shards"]]
    shards[0]["checksums"]["topk_ids"] = "0" * 32
    found, _ = verify._check_arrays(cache, STORE, {**manifest, "shards": shards}, samples, group)
    assert len(found) == 1 and "topk_ids shard 0 (tokens 0.." in found[0] and "affects samples 0" in found[0]
    fewer = {**manifest, "shards": manifest["shards"][:-1]}  # a shard the manifest lost
    found, _ = verify._check_arrays(cache, STORE, fewer, samples, group)
    covered = int(manifest["shards"][-2]["stop"])
    assert found == [f"{STORE}: manifest shards cover {covered} tokens, committed {sum(LENGTHS)}"]
    longer = {**manifest, "committed_tokens": sum(LENGTHS) + 1}  # arrays shorter than the commit
    found, _ = verify._check_arrays(cache, STORE, longer, samples, group)
    assert (
        f"{STORE}: array input_ids has shape ({sum(LENGTHS)},) int32, expected [>={sum(LENGTHS) + 1}, ] int32"
        in found
    )


def test_a_missing_array_and_an_unreadable_group(tmp_path):
    cache, manifest, samples = _opened(tmp_path)  # opened before the damage (open_cache refuses it after)
    store = tmp_path / "c" / layout.STORES_DIR / STORE
    shutil.rmtree(store / "topk_logprobs")
    group = cache._root.zarr_group(f"{layout.STORES_DIR}/{STORE}")
    found, data = verify._check_arrays(cache, STORE, manifest, samples, group)
    assert len(found) == 1 and found[0].startswith(f"{STORE}: array topk_logprobs missing or unreadable")
    assert set(data) == {"input_ids", "loss_mask", "topk_ids"}
    (store / "zarr.json").write_text("{damaged")
    found = verify._verify_store(cache, STORE, manifest, {})
    assert found[-1].startswith(f"{STORE}: Zarr group unreadable") and "every sample" in found[-1]


def test_values_checks_supervised_counts_and_id_ranges(tmp_path):
    cache, manifest, samples = _opened(tmp_path)
    group = cache._root.zarr_group(f"{layout.STORES_DIR}/{STORE}")
    _, data = verify._check_arrays(cache, STORE, manifest, samples, group)
    assert verify._verify_values(cache, STORE, samples, data) == []
    mask = data["loss_mask"].copy()
    off, n = int(samples.loc[3, "offset"]), int(samples.loc[3, "length"])
    mask[off : off + n] = ~mask[off : off + n]
    found = verify._verify_values(cache, STORE, samples, {**data, "loss_mask": mask})
    assert any(
        f"num_supervised disagrees with loss_mask for samples [{samples.loc[3, 'sample_id']}" in p
        for p in found
    )
    assert any("token_counts.npy disagrees with the supervised tokens" in p for p in found), found
    ids = data["input_ids"].copy()
    ids[0] = cache.meta.vocab_size
    found = verify._verify_values(cache, STORE, samples, {**data, "input_ids": ids})
    assert f"{STORE}: input_ids outside 0..{cache.meta.vocab_size - 1}" in found


def test_findings_tell_damage_from_incomplete(tmp_path):
    write_cache(tmp_path / "c", close=False)  # committed shards, never completed
    manifest = json.loads((tmp_path / "c" / layout.STORES_DIR / STORE / layout.MANIFEST).read_text())
    assert not manifest["complete"]
    found = verify_cache(open_cache(tmp_path / "c", check=False))
    assert [getattr(p, "kind", "damage") for p in found] == ["incomplete"]
    assert Finding("x").kind == "damage" and Finding.incomplete("y").kind == "incomplete"
    shutil.rmtree(tmp_path / "c" / layout.STORES_DIR / STORE)
    cache = open_cache(tmp_path / "c", check=False)
    found = verify_cache(cache)
    assert found == [f"{STORE}: store missing (no manifest)"] and found[0].kind == "incomplete"
