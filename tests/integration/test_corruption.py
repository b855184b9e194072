"""Flip one byte in every kind of file of a real cache store, one at a time: `peagle-pipeline verify` must detect
each flip (exit 4) and name the store (and the samples, for array shards). Training must refuse a corrupted
sample with one clear line, or skip and report it with --skip-corrupt.

The CLI runs in process: through `cli.main(argv)` (the real entry point and error boundary) for the many verify
calls, and through tests/cli_run.py for training.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from cli_run import Result, peagle

from peagle_pipeline import cli
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.stages.train import metrics

pytestmark = pytest.mark.slow

STORE = layout.store_name(0, 1)
SEED = int(os.environ.get("PEAGLE_CORRUPT_SEED", "7"))
DETECTED: list[str] = []  # file kinds detected, for the summary line


def _shard_files(store: Path, array: str) -> list[Path]:
    return sorted(p for p in (store / array / "c").rglob("*") if p.is_file())


def _targets(cache: Path) -> list[tuple[str, str, tuple[int, int], bool]]:
    """(kind, file relative to the store, (lo, hi) byte range to flip in, names samples?) of every kind of file."""
    store = cache / layout.STORES_DIR / STORE
    meta = json.loads((cache / layout.CACHE_META).read_text())
    out = []
    for array in layout.array_specs(open_cache(cache).meta):
        chunks = meta["shard_tokens"] // meta["chunk_tokens"]
        index_bytes = chunks * layout.SHARD_INDEX_ENTRY + 4
        for shard in _shard_files(store, array):
            size = shard.stat().st_size
            rel = str(shard.relative_to(store))
            out.append((f"{array} shard data", rel, (0, size - index_bytes), True))
        out.append(
            (
                f"{array} shard index",
                str(_shard_files(store, array)[0].relative_to(store)),
                (size - index_bytes, size),
                True,
            )
        )
        out.append(
            (
                f"{array} zarr.json",
                f"{array}/zarr.json",
                (0, (store / array / "zarr.json").stat().st_size),
                False,
            )
        )
    for table in (layout.SAMPLES_TABLE, layout.REJECTS_TABLE, layout.TOKEN_COUNTS):
        out.append((table, table, (0, (store / table).stat().st_size), False))
    text = (store / layout.MANIFEST).read_text()
    digest = json.loads(text)["shards"][0]["checksums"]["aux_hidden"]
    pos = text.index(digest)
    out.append(("manifest checksum digit", layout.MANIFEST, (pos, pos + len(digest)), False))
    out.append(("manifest syntax", layout.MANIFEST, (0, 1), False))
    return out


def _flip(path: Path, lo: int, hi: int, rng: random.Random) -> int:
    blob = bytearray(path.read_bytes())
    pos = rng.randrange(lo, hi)
    old = blob[pos]
    if path.suffix == ".json" and chr(old) in "0123456789abcdef":  # stay valid JSON: another hex digit
        blob[pos] = ord("0123456789abcdef"[("0123456789abcdef".index(chr(old)) + 7) % 16])
    else:
        blob[pos] = old ^ (1 << rng.randrange(8))
    path.write_bytes(bytes(blob))
    return pos


@pytest.fixture(scope="module")
def pristine(tiny_cache: Path, tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("corrupt") / "pristine"
    shutil.copytree(tiny_cache, copy)
    assert cli.main(["verify", str(copy)]) == 0
    return copy


def test_verify_detects_every_single_byte_flip(pristine: Path, tmp_path: Path, capsys) -> None:
    rng = random.Random(SEED)
    targets = _targets(pristine)
    missed = []
    for i, (kind, rel, (lo, hi), names_samples) in enumerate(targets):
        work = tmp_path / f"c{i}"
        shutil.copytree(pristine, work)
        pos = _flip(work / layout.STORES_DIR / STORE / rel, lo, hi, rng)
        capsys.readouterr()
        code = cli.main(["verify", str(work)])
        text = "\n".join(capsys.readouterr())
        ok = code == 4 and STORE in text and "Traceback" not in text
        if names_samples:
            ok = ok and "samples " in text
        (DETECTED if ok else missed).append(f"{kind} ({rel} byte {pos}): exit {code}: {text.strip()[:300]}")
        shutil.rmtree(work)
    print(f"\ncorruption: {len(DETECTED)}/{len(targets)} single-byte flips detected by verify")
    assert not missed, "\n".join(missed)
    assert len(targets) >= 20


def _train(cache: Path, out: Path, *extra: str) -> Result:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    env.pop("PEAGLE_DEBUG", None)
    flags = [
        "--depths",
        "2",
        "--tokens-per-step",
        "256",
        "--epochs",
        "1",
        "--eval-samples",
        "0",
        "--precision",
        "fp32",
        "--draft-vocab-size",
        "300",
        "--num-workers",
        "0",
        "--warmup",
        "0",
        "--no-export",
        "--log-every",
        "1",
    ]
    return peagle("train", "--cache", str(cache), "--output", str(out), *flags, *extra, env=env, check=False)


def test_training_refuses_or_skips_a_corrupted_sample(pristine: Path, tmp_path: Path) -> None:
    """One aux_hidden chunk damaged (the first 256 tokens): training stops naming it, or skips and reports it."""
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    shard = _shard_files(cache / layout.STORES_DIR / STORE, "aux_hidden")[0]
    _flip(shard, 1000, 1001, random.Random(0))  # inside the first inner chunk's zstd frame
    hit = open_cache(cache).samples.query("offset < 256")["sample_id"].tolist()
    assert hit

    refused = _train(cache, tmp_path / "refuse")
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 4, refused.stderr[-2000:]
    # one error line, the last (train's status lines, e.g. the draft vocabulary's coverage, may come first)
    errors = [line for line in lines if line.startswith("error")]
    assert "Traceback" not in refused.stderr and errors == lines[-1:] and lines[-1].startswith("error: "), (
        refused.stderr
    )
    assert STORE in lines[-1] and "--resume --skip-corrupt" in lines[-1]
    assert any(f"(sample {sid})" in lines[-1] for sid in hit), lines[-1]
    # the advice works on the stopped run, which has trained (a resume may change skip_corrupt)
    assert any(r["kind"] == "train" for r in metrics.read_metrics(tmp_path / "refuse"))
    advised = _train(cache, tmp_path / "refuse", "--resume", "--skip-corrupt")
    assert advised.returncode == 0, advised.stderr[-2000:]
    done = [r for r in metrics.read_metrics(tmp_path / "refuse") if r["kind"] == "train"]
    assert done[-1]["skipped_corrupt"] == len(hit)

    skipped = _train(cache, tmp_path / "skip", "--skip-corrupt")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "skipped" in skipped.stderr and "corrupt" in skipped.stderr
    records = [r for r in metrics.read_metrics(tmp_path / "skip") if r["kind"] == "train"]
    assert records[-1]["skipped_corrupt"] == len(hit)
    print(
        f"\ncorruption: training refused (exit 4) and skipped {records[-1]['skipped_corrupt']} corrupt sample(s)"
    )


# ------------------------------------------------------------------------------------------ numerical faults
def _poison_aux(cache: Path, sample_ids: list[int] | None) -> None:
    """Write NaN into the aux states of some samples (all when None) and re-seal the manifest checksums.

    The result is a *valid* cache (verify passes) whose values are non-finite, as a broken target would give.
    """
    import numpy as np
    import zarr

    from peagle_pipeline.runtime import atomic_write_json

    store = cache / layout.STORES_DIR / STORE
    arr = zarr.open_group(str(store), mode="r+")["aux_hidden"]
    table = open_cache(cache).samples
    rows = table if sample_ids is None else table[table["sample_id"].isin(sample_ids)]
    for off, n in rows[["offset", "length"]].itertuples(index=False):
        arr[off : off + n] = np.nan
    manifest = json.loads((store / layout.MANIFEST).read_text())
    for shard in manifest["shards"]:
        shard["checksums"]["aux_hidden"] = layout.checksum(np.asarray(arr[shard["start"] : shard["stop"]]))
    atomic_write_json(store / layout.MANIFEST, manifest)
    assert verify_cache(open_cache(cache)) == []


def test_nan_steps_are_skipped_and_reported_then_stop_with_exit_8(pristine: Path, tmp_path: Path) -> None:
    some = tmp_path / "some-nan"
    shutil.copytree(pristine, some)
    ids = open_cache(some).samples["sample_id"].tolist()
    _poison_aux(some, ids[:3])
    ok = _train(some, tmp_path / "skip", "--max-bad-steps", "5")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "non-finite loss or gradient" in ok.stderr and "update skipped" in ok.stderr
    records = [r for r in metrics.read_metrics(tmp_path / "skip") if r["kind"] == "train"]
    skipped = sum(r["skipped_steps"] for r in records)
    assert 1 <= skipped < len(records)
    from safetensors.torch import load_file

    final = sorted((tmp_path / "skip" / "checkpoints").glob("step-*"))[-1]
    assert all(bool(t.isfinite().all()) for t in load_file(str(final / "model.safetensors")).values())

    every = tmp_path / "all-nan"
    shutil.copytree(pristine, every)
    _poison_aux(every, None)
    bad = _train(every, tmp_path / "stop", "--max-bad-steps", "3")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 8, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr and lines[-1].startswith("error: 3 consecutive steps")
    assert sum("update skipped" in line for line in lines) == 3
    print(
        f"\nnumerical faults: {skipped} NaN step(s) skipped and reported of {len(records)}; all-NaN cache "
        "stopped after 3 bad steps with exit 8"
    )


def test_verify_checks_target_and_names_missing_files_as_missing(
    pristine: Path, tmp_path: Path, capsys
) -> None:
    """Deleted files are missing, not failing checksums; target/ is part of the cache; training on a cache without
    target/pieces.safetensors says so in one line; verify's own advice never points at verify."""

    def verify(work: Path) -> tuple[int, str]:
        capsys.readouterr()
        code = cli.main(["verify", str(work)])
        return code, "\n".join(capsys.readouterr())

    pieces = tmp_path / "pieces"
    shutil.copytree(pristine, pieces)
    (pieces / layout.TARGET_DIR / layout.PIECES_FILE).unlink()
    code, text = verify(pieces)
    assert code == 4 and f"{pieces}: target/{layout.PIECES_FILE} is missing" in text
    capsys.readouterr()
    argv = [
        "train",
        "--cache",
        str(pieces),
        "--output",
        str(tmp_path / "run"),
        "--steps",
        "1",
        "--precision",
        "fp32",
    ]
    argv += ["--no-export", "--num-workers", "0", "--eval-samples", "0", "--draft-vocab-size", "300"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert (
        code == 4 and err.count("\n") == 1 and err.startswith(f"error: {pieces}: target/{layout.PIECES_FILE}")
    )
    assert "is missing" in err

    truncated = tmp_path / "truncated"
    shutil.copytree(pristine, truncated)
    path = truncated / layout.TARGET_DIR / layout.PIECES_FILE
    path.write_bytes(path.read_bytes()[:4096])
    code, text = verify(truncated)
    assert code == 4 and f"target/{layout.PIECES_FILE} is damaged (truncated: 4096 bytes" in text

    shard = tmp_path / "shard"
    shutil.copytree(pristine, shard)
    store = shard / layout.STORES_DIR / STORE
    gone = _shard_files(store, "aux_hidden")[0]
    gone.unlink()
    code, text = verify(shard)
    assert code == 4 and f"shard file {gone.relative_to(store)} is missing; affects samples" in text
    assert "checksum" not in text.split("is missing")[0]

    table = tmp_path / "table"
    shutil.copytree(pristine, table)
    (table / layout.STORES_DIR / STORE / layout.SAMPLES_TABLE).write_bytes(b"not parquet")
    code, text = verify(table)
    assert code == 4 and layout.SAMPLES_TABLE in text and "verify" not in text.replace(f"in {table}", "")
