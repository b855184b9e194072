"""The opt-in lossy caches (`extract --dtype fp8`, `--dtype nf4`) end to end on the tiny model: recorded in
cache.json, verified, inspected, read back close to the lossless fp32 cache of the same forward, smaller on disk,
resumed after kill -9 to byte-identical shards, trained on and exported; and bad values of the setting refused
with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from cli_argv import PEAGLE, end_of_killed_runs, extract_argv, start_cli
from cli_run import peagle

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.data.chat import ChatRenderer
from peagle_pipeline.model_dir import load_tokenizer, read_target_info
from peagle_pipeline.stages.extract import plan
from peagle_pipeline.stages.extract.settings import settle
from peagle_pipeline.stages.train import metrics

pytestmark = pytest.mark.slow

# tiny_cache's settings (the same batches, so the same forward), in fp32
FLAGS = ["--max-length", "256", "--shard-tokens", "2048", "--chunk-tokens", "256", "--compute-dtype", "fp32"]


class Lossy(NamedTuple):
    flag: str  # the --dtype value
    name: str  # cache.json's hidden_dtype
    sample_err: float  # largest relative L2 error of one sample's aux states
    cache_err: float  # relative L2 error over the cache
    ratio: tuple[float, float]  # bytes of aux_hidden against the fp32 cache's (hidden size 64)


KINDS = {
    # fp32 -> fp8: a quarter of the bytes, plus 4 bytes of scale per 64-value row
    "fp8": Lossy("fp8", "float8_e4m3", 0.05, 0.04, (0.25, 0.30)),
    # fp32 -> nf4: 32 code bytes, 2 block scales, a 4-byte row scale and 4 outliers of 4 bytes: 54 of 256 bytes
    "nf4": Lossy("nf4", "nf4", 0.15, 0.12, (0.20, 0.23)),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def lossy(request, tiny_model: Path, conversations: Path, tmp_path_factory) -> tuple[Lossy, Path]:
    kind = KINDS[request.param]
    out = tmp_path_factory.mktemp(kind.flag) / "cache"
    peagle("extract", "--model", str(tiny_model), "--data", str(conversations), "--output", str(out),
               "--dtype", kind.flag, *FLAGS)  # fmt: skip
    return kind, out


def _hidden_bytes(cache: Path) -> int:
    return sum(f.stat().st_size for f in (cache / layout.STORES_DIR).rglob("*") if "aux_hidden" in f.parts)


def test_lossy_cache_reads_back_close_to_the_lossless_cache(
    lossy: tuple[Lossy, Path], tiny_cache: Path, tiny_model: Path, conversations: Path
) -> None:
    """tiny_cache holds the same fp32 forward stored as fp32 (lossless). The size estimate `extract` started with is
    close to the cache."""
    kind, cache = lossy
    assert json.loads((cache / layout.CACHE_META).read_text())["hidden_dtype"] == kind.name
    read, exact = open_cache(cache), open_cache(tiny_cache)
    assert verify_cache(read) == [] and list(read.samples["sample_id"]) == list(exact.samples["sample_id"])
    num = den = 0.0
    for sid in read.samples["sample_id"]:
        a, b = read.read_sample(int(sid)), exact.read_sample(int(sid))
        assert a.aux_hidden.dtype == torch.bfloat16 and a.aux_hidden.shape == b.aux_hidden.shape
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.topk_ids, b.topk_ids)
        err = a.aux_hidden.float() - b.aux_hidden
        num, den = num + float(err.square().sum()), den + float(b.aux_hidden.square().sum())
        assert float(err.norm() / b.aux_hidden.norm()) < kind.sample_err, int(sid)
    assert (num / den) ** 0.5 < kind.cache_err
    ratio = _hidden_bytes(cache) / _hidden_bytes(tiny_cache)
    assert kind.ratio[0] < ratio < kind.ratio[1], ratio
    cfg = ExtractConfig(model=str(tiny_model), data=[str(conversations)], output=str(cache), dtype=kind.flag,  # type: ignore[arg-type]
                        max_length=256, shard_tokens=2048, chunk_tokens=256)  # fmt: skip
    info = read_target_info(tiny_model)
    renderer = ChatRenderer(load_tokenizer(str(tiny_model)), "all", "context")
    est = plan.estimate(settle(cfg, info, None, "cpu", (0, 1)), renderer)
    actual = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    # within 10 % on a real target (tests/real); the tiny random target's top-k ids and log-probs compress
    # better than a real model's (ids < 512, flat distributions), which the estimate cannot know
    assert abs(est.total - actual) / actual < 0.15, (est.describe(), actual)


def test_verify_inspect_train_and_export_on_a_lossy_cache(lossy: tuple[Lossy, Path], tmp_path: Path) -> None:
    kind, cache = lossy
    assert peagle("verify", str(cache)).returncode == 0
    assert f"hidden dtype {kind.name}" in peagle("inspect", str(cache)).stdout
    out = tmp_path / "run"
    peagle("train", "--cache", str(cache), "--output", str(out), "--steps", "4", "--depths", "3",
               "--tokens-per-step", "256", "--eval-every", "2", "--eval-samples", "4", "--precision", "fp32",
               "--draft-vocab-size", "300", "--num-workers", "0")  # fmt: skip
    losses = [r["loss"] for r in metrics.read_metrics(out) if r["kind"] == "train"]
    assert len(losses) >= 1 and all(torch.isfinite(torch.tensor(losses)))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert (out / "export" / "config.json").is_file() and list((out / "export").glob("*.safetensors"))


def _manifest(cache: Path) -> dict | None:
    path = cache / layout.STORES_DIR / layout.store_name(0, 1) / layout.MANIFEST
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _store_files(cache: Path) -> dict[str, bytes]:
    """Every store file but the manifest (it counts commits) and the writer's lock."""
    stores = cache / layout.STORES_DIR
    return {
        str(p.relative_to(stores)): p.read_bytes()
        for p in sorted(stores.rglob("*"))
        if p.is_file() and p.name != layout.MANIFEST and not p.name.endswith(".lock")
    }


@pytest.mark.crash
def test_kill9_after_a_commit_then_resume_writes_the_same_shard_files(
    lossy: tuple[Lossy, Path], tiny_model: Path, conversations: Path, tmp_path: Path
) -> None:
    """The lossy rows are a pure function of the forward's: a resumed extraction recomputes the batch of the first
    uncommitted sample and stores every shard byte for byte as the uninterrupted run (the fixture's cache)."""
    kind, ref = lossy
    out = tmp_path / "resumed"
    cmd = extract_argv(tiny_model, conversations, out, "--dtype", kind.flag, *FLAGS)
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PEAGLE_TEST_COMMIT_SLEEP="0.3")
    proc = start_cli(
        cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 180
    try:
        while (m := _manifest(out)) is None or m["commits"] < 1:
            assert proc.poll() is None, "the run ended before its first commit"
            assert time.monotonic() < deadline, "no commit within 180 s"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        end_of_killed_runs()
        if proc.stderr:
            proc.stderr.close()
    man = _manifest(out)
    assert man is not None and not man["complete"], "the kill came too late to interrupt anything"
    final = peagle(
        *cmd[len(PEAGLE) :], env=dict(env, PEAGLE_TEST_COMMIT_SLEEP="0"), check=False
    )  # in process
    assert final.code == 0, final.stderr[-2000:]
    assert "estimated cache size" in final.stderr and "already written" in final.stderr, final.stderr[-2000:]
    assert verify_cache(open_cache(out)) == []
    a, b = _store_files(ref), _store_files(out)
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []


def test_resuming_with_another_dtype_and_bad_values_are_refused(lossy: tuple[Lossy, Path], tiny_model: Path,
                                                                conversations: Path, tmp_path: Path) -> None:  # fmt: skip
    _, cache = lossy
    base = ["extract", "--model", str(tiny_model), "--data", str(conversations)]
    other = peagle(*base, "--output", str(cache), "--dtype", "bf16", *FLAGS, check=False)
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 5 and len(lines) == 1 and "hidden_dtype" in lines[0], other.stderr
    choices = "error: dtype must be one of bf16, fp32, fp8, nf4; got"
    bad = peagle(*base, "--output", str(tmp_path / "c"), "--dtype", "fp9", check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == f"{choices} 'fp9'"
    (tmp_path / "p.yaml").write_text("extract:\n  dtype: e4m3\n")
    bad = peagle(*base, "-c", str(tmp_path / "p.yaml"), "--output", str(tmp_path / "c"), check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == f"{choices} 'e4m3'"
    assert not (tmp_path / "c").exists()
