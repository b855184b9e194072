"""The opt-in fp8 cache (`extract --dtype fp8`) end to end on the tiny model: recorded in cache.json, verified,
inspected, read back close to the lossless fp32 cache of the same forward, smaller on disk, trained on; and bad
values of the setting refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_run import peagle

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.stages.train import metrics

pytestmark = pytest.mark.slow

FLAGS = ["--max-length", "256", "--shard-tokens", "2048", "--chunk-tokens", "256", "--compute-dtype", "fp32"]


@pytest.fixture(scope="module")
def fp8_cache(tiny_model: Path, conversations: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "cache"
    peagle("extract", "--model", str(tiny_model), "--data", str(conversations), "--output", str(out),
               "--dtype", "fp8", *FLAGS)  # fmt: skip
    return out


def _hidden_bytes(cache: Path) -> int:
    return sum(f.stat().st_size for f in (cache / layout.STORES_DIR).rglob("*") if "aux_hidden" in f.parts)


def test_fp8_cache_reads_back_close_to_the_lossless_cache(fp8_cache: Path, tiny_cache: Path) -> None:
    """tiny_cache holds the same fp32 forward stored as fp32 (lossless)."""
    assert json.loads((fp8_cache / layout.CACHE_META).read_text())["hidden_dtype"] == "float8_e4m3"
    lossy, exact = open_cache(fp8_cache), open_cache(tiny_cache)
    assert verify_cache(lossy) == [] and list(lossy.samples["sample_id"]) == list(exact.samples["sample_id"])
    num = den = 0.0
    for sid in lossy.samples["sample_id"]:
        a, b = lossy.read_sample(int(sid)), exact.read_sample(int(sid))
        assert a.aux_hidden.dtype == torch.bfloat16 and a.aux_hidden.shape == b.aux_hidden.shape
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.topk_ids, b.topk_ids)
        err = a.aux_hidden.float() - b.aux_hidden
        num, den = num + float(err.square().sum()), den + float(b.aux_hidden.square().sum())
        assert float(err.norm() / b.aux_hidden.norm()) < 0.05, int(sid)
    assert (num / den) ** 0.5 < 0.04  # relative L2 error over the cache (~2.5 %)
    # fp32 -> fp8: a quarter of the bytes, plus 4 bytes of scale per 64-value row (hidden size 64)
    ratio = _hidden_bytes(fp8_cache) / _hidden_bytes(tiny_cache)
    assert 0.25 < ratio < 0.30, ratio


def test_verify_inspect_and_train_on_an_fp8_cache(fp8_cache: Path, tmp_path: Path) -> None:
    assert peagle("verify", str(fp8_cache)).returncode == 0
    assert "float8_e4m3" in peagle("inspect", str(fp8_cache)).stdout
    out = tmp_path / "run"
    peagle("train", "--cache", str(fp8_cache), "--output", str(out), "--steps", "4", "--depths", "3",
               "--tokens-per-step", "256", "--eval-every", "2", "--eval-samples", "4", "--precision", "fp32",
               "--draft-vocab-size", "300", "--num-workers", "0", "--no-export")  # fmt: skip
    losses = [r["loss"] for r in metrics.read_metrics(out) if r["kind"] == "train"]
    assert len(losses) >= 1 and all(torch.isfinite(torch.tensor(losses)))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000004"


def test_resuming_with_another_dtype_and_bad_values_are_refused(fp8_cache: Path, tiny_model: Path,
                                                                conversations: Path, tmp_path: Path) -> None:  # fmt: skip
    base = ["extract", "--model", str(tiny_model), "--data", str(conversations)]
    other = peagle(*base, "--output", str(fp8_cache), "--dtype", "bf16", *FLAGS, check=False)
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 5 and len(lines) == 1 and "hidden_dtype" in lines[0], other.stderr
    bad = peagle(*base, "--output", str(tmp_path / "c"), "--dtype", "fp9", check=False)
    assert (
        bad.returncode == 2 and bad.stderr.strip() == "error: dtype must be one of bf16, fp32, fp8; got 'fp9'"
    )
    (tmp_path / "p.yaml").write_text("extract:\n  dtype: e4m3\n")
    bad = peagle(*base, "-c", str(tmp_path / "p.yaml"), "--output", str(tmp_path / "c"), check=False)
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: dtype must be one of bf16, fp32, fp8; got 'e4m3'"
    )
    assert not (tmp_path / "c").exists()
