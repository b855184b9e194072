"""The compute dtype picked from the hardware, on the real tiny model: extraction's forward dtype (recorded in
cache.json, kept on resume, separate from the stored dtype) and training's precision. Both CPU branches run on any
host through PEAGLE_CPU_BF16 (the detection itself is tested in tests/unit/test_runtime.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from peagle_pipeline.backends.hf import HFBackend
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.errors import ResumeMismatch
from peagle_pipeline.hardware import CPU_BF16_ENV
from peagle_pipeline.stages.extract import stage
from peagle_pipeline.stages.extract.settings import backend_settings, forward_dtype


def _data(path: Path, n: int = 2) -> Path:
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"question {i} about the quick brown fox"},
                    {"role": "assistant", "content": "the answer is " + "paris " * (i + 4)},
                ]
            }
        )
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(model: Path, data: Path, out: Path, **over) -> ExtractConfig:
    base = dict(model=str(model), data=[str(data)], output=str(out), topk=8, device="cpu", batch_tokens=64)
    base.update(over)
    return ExtractConfig(**base)


def _stored_aux(root: Path) -> tuple[list[int], torch.Tensor]:
    cache = open_cache(root)
    s = cache.read_sample(int(cache.samples["sample_id"][0]))
    return s.input_ids.tolist(), s.aux_hidden


def test_forward_dtype_rules(monkeypatch, tmp_path):
    cfg = _cfg(tmp_path / "m", tmp_path / "d", tmp_path / "o")
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert forward_dtype(cfg, "cpu") == "bf16"
    assert (
        forward_dtype(dataclasses.replace(cfg, dtype="fp32"), "cpu") == "fp32"
    )  # fp32 storage: fp32 forward
    assert forward_dtype(dataclasses.replace(cfg, dtype="fp32", compute_dtype="bf16"), "cpu") == "bf16"
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert forward_dtype(cfg, "cpu") == "fp32"
    assert forward_dtype(dataclasses.replace(cfg, compute_dtype="bf16"), "cpu") == "bf16"
    assert forward_dtype(cfg, "cuda") == "bf16"


@pytest.mark.parametrize("units", ["0", "1"])
def test_extraction_computes_in_the_chosen_dtype_and_stores_bf16(tiny_model, tmp_path, monkeypatch, units):
    monkeypatch.setenv(CPU_BF16_ENV, units)
    chosen = "bf16" if units == "1" else "fp32"
    data = _data(tmp_path / "d.jsonl", 1)  # one sample = one batch of one: the forward below is the same call
    summary = stage.run(_cfg(tiny_model, data, tmp_path / "c"))
    assert f"compute dtype {chosen} on cpu (auto: {CPU_BF16_ENV}={units}); stored hidden states bf16" in (
        summary.format()
    )
    meta = open_cache(tmp_path / "c").meta
    assert meta.hidden_dtype == "bfloat16"
    assert meta.compute_dtype == {"bf16": "bfloat16", "fp32": "float32"}[chosen]
    ids, stored = _stored_aux(tmp_path / "c")
    outs = {}
    for dtype in ("bf16", "fp32"):  # the same forward in each dtype, rounded to bf16 as the cache stores it
        backend = HFBackend(
            backend_settings(_cfg(tiny_model, data, tmp_path / "x", compute_dtype=dtype)), meta.aux_layer_ids
        )
        outs[dtype] = backend.forward([ids])[0].aux_hidden.to(torch.bfloat16)
        backend.close()
    assert not torch.equal(outs["bf16"], outs["fp32"])  # so the check below can tell them apart
    assert torch.equal(stored, outs[chosen])


def test_resume_and_other_ranks_keep_the_cache_compute_dtype(tiny_model, tmp_path, monkeypatch):
    data = _data(tmp_path / "d.jsonl", 4)
    out = tmp_path / "c"
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    stage.run(_cfg(tiny_model, data, out, rank=0, world_size=2))
    monkeypatch.setenv(CPU_BF16_ENV, "0")  # rank 1 on a host without bf16 units, auto: keeps the cache's bf16
    with pytest.raises(ResumeMismatch, match="compute_dtype: 'bfloat16' in the cache, 'float32' now"):
        stage.run(_cfg(tiny_model, data, out, rank=1, world_size=2, compute_dtype="fp32"))
    summary = stage.run(_cfg(tiny_model, data, out, rank=1, world_size=2))
    assert "compute dtype bf16 on cpu (auto: kept from the cache being resumed)" in summary.format()
    cache = open_cache(out)
    assert cache.meta.compute_dtype == "bfloat16" and len(cache.samples) == 4


def test_cache_from_before_compute_dtype_resumes(tiny_model, tmp_path, monkeypatch):
    """A cache.json without compute_dtype computed in its stored dtype: auto and that explicit dtype resume it."""
    data = _data(tmp_path / "d.jsonl", 4)
    out = tmp_path / "c"
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    stage.run(_cfg(tiny_model, data, out, rank=0, world_size=2, dtype="fp32"))
    meta_path = out / "cache.json"
    old = json.loads(meta_path.read_text())
    assert old.pop("compute_dtype") == "float32"
    meta_path.write_text(json.dumps(old))
    with pytest.raises(ResumeMismatch, match="compute_dtype"):
        stage.run(_cfg(tiny_model, data, out, rank=1, world_size=2, dtype="fp32", compute_dtype="bf16"))
    stage.run(_cfg(tiny_model, data, out, rank=1, world_size=2, dtype="fp32"))
    cache = open_cache(out)
    assert cache.meta.compute_dtype == "float32" and len(cache.samples) == 4


@pytest.mark.slow
def test_training_precision_auto_follows_the_cpu(tiny_cache, tmp_path, monkeypatch, caplog):
    from peagle_pipeline.cli import main
    from peagle_pipeline.stages.train import metrics

    argv = ["train", "--cache", str(tiny_cache), "--steps", "2", "--tokens-per-step", "256", "--depths", "2"]
    argv += ["--eval-samples", "4", "--log-every", "1", "--num-workers", "0", "--draft-vocab-size", "300"]
    argv += ["--no-export", "--device", "cpu"]
    losses = {}
    for units, chosen in (("0", "fp32"), ("1", "bf16")):
        monkeypatch.setenv(CPU_BF16_ENV, units)
        run = tmp_path / f"run-{units}"
        caplog.clear()
        with caplog.at_level("INFO", logger="peagle_pipeline.stages.train.stage"):
            assert main([*argv, "--output", str(run)]) == 0
        assert f"compute dtype {chosen} on cpu (auto: {CPU_BF16_ENV}={units})" in caplog.text
        losses[chosen] = [r["loss"] for r in metrics.read_metrics(run) if r.get("kind") == "train"]
    assert losses["fp32"] and losses["bf16"]
    assert losses["fp32"][0] != losses["bf16"][0]  # autocast really was on for one and off for the other
