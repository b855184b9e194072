"""Llama 4 targets end to end, text-only (Llama4ForCausalLM) and as they ship (Llama4ForConditionalGeneration): the
text model keeps its layers under `model` though its checkpoint prefix, its `base_model_prefix`, is `language_model`
(`extract` failed with a traceback on it). Extracted with chunked attention past one chunk, trained from the last
layer's attention (its MLP is a mixture of experts) and exported with the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_run import peagle
from tiny import build_tiny_llama4, write_conversations

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["text", "multimodal"])
def llama4_run(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the target, a 2-step run on its cache exported to RUN/export, its terminal in RUN/output.txt)."""
    tmp = tmp_path_factory.mktemp(f"llama4-{request.param}")
    target = build_tiny_llama4(tmp / "model", multimodal=request.param == "multimodal")
    data = write_conversations(tmp / "conv.jsonl", 16)
    cache, run = tmp / "cache", tmp / "run"
    peagle(
        *["extract", "--model", str(target), "--data", str(data), "--output", str(cache)],
        *["--dtype", "fp32", "--max-length", "256", "--layers", "0,1,2"],
    )
    proc = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *["--steps", "2", "--eval-every", "2", "--save-every", "2", "--eval-samples", "4"],
        *["--precision", "fp32", "--num-workers", "0"],
    )
    (run / "output.txt").write_text(proc.stdout + proc.stderr)
    return target, run


def test_the_cache_holds_the_targets_own_log_probs(llama4_run: tuple[Path, Path]) -> None:
    """Samples longer than one 128-token attention chunk carry the model's own log-probs (top-k at the cache's
    precision)."""
    from transformers import AutoConfig, Llama4ForCausalLM, Llama4ForConditionalGeneration

    from peagle_pipeline.cache.reader import open_cache

    target, run = llama4_run
    multimodal = AutoConfig.from_pretrained(str(target)).model_type == "llama4"
    cls = Llama4ForConditionalGeneration if multimodal else Llama4ForCausalLM
    model = cls.from_pretrained(str(target), dtype=torch.float32).eval()
    cache = open_cache(str(run.parent / "cache"))
    samples = cache.samples
    long = [int(i) for i in samples.loc[samples["length"] > 128, "sample_id"]]
    assert long
    for sample_id in long[:2]:
        s = cache.read_sample(sample_id)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=s.input_ids[None]).logits[0].float(), -1)
        torch.testing.assert_close(logprobs.gather(1, s.topk_ids), s.topk_logprobs, rtol=0, atol=2e-3)


def test_the_draft_starts_from_the_last_layers_attention_and_exports_a_llama_layer(
    llama4_run: tuple[Path, Path],
) -> None:
    target, run = llama4_run
    out = (run / "output.txt").read_text()
    assert "held-out: loss" in out
    assert "starts from target layer 3's attention (its MLP is a mixture of experts" in out
    assert "a layer without RoPE (the draft's attention rotates)" in out  # Llama 4's every fourth layer
    layer = json.loads((run / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["hidden_size"] == 64
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
