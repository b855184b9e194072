"""A Gemma 3 target (text): its RMS norms scale by 1 + w, so the exact target (the stored last hidden state through
the final norm and lm_head, `train --target exact`) must read the final norm's weight as 1 + w. Gemma 3 does not
soft-cap its logits, so `--target exact` is allowed there (Gemma 2's and Gemma 4's soft caps are refused). Gemma 3
4B-27B ship as vision-language checkpoints: the HF backend runs their language model on the text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_run import peagle
from tiny import build_tiny_gemma3, write_conversations

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("multimodal", [False, True])
def test_the_exact_target_of_a_gemma3_reproduces_its_log_probs(tmp_path: Path, multimodal: bool) -> None:
    """The exact target gives the target's log-probs (it fails with the norm read as w); and those log-probs are
    the model's own, a vision-language checkpoint's included."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from peagle_pipeline.cache.reader import open_cache

    model = build_tiny_gemma3(tmp_path / "gemma3", multimodal=multimodal)
    data = write_conversations(tmp_path / "conv.jsonl", 12)
    cache, run = tmp_path / "cache", tmp_path / "run"
    peagle(
        *["extract", "--model", str(model), "--data", str(data), "--output", str(cache), "--last-hidden"],
        *["--dtype", "fp32", "--max-length", "256", "--layers", "0,1,2"],
    )
    proc = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *["--steps", "2", "--eval-every", "2", "--save-every", "2", "--eval-samples", "4"],
        *["--precision", "fp32", "--num-workers", "0", "--target", "exact"],
    )
    assert "held-out: loss" in proc.stdout + proc.stderr  # trained on the exact target and exported
    reader = open_cache(str(cache))
    pieces = reader.target_pieces()
    config = reader.target_config()
    eps = config.get("text_config", config)["rms_norm_eps"]
    own_model = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    target = own_model.from_pretrained(str(model), dtype=torch.float32).eval()
    for sample_id in (0, 3):
        s = reader.read_sample(sample_id)
        h = s.last_hidden.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * pieces["norm.weight"].float()
        logprobs = torch.log_softmax(normed @ pieces["lm_head.weight"].float().T, -1)
        torch.testing.assert_close(logprobs.gather(1, s.topk_ids), s.topk_logprobs, rtol=0, atol=2e-3)
        with torch.no_grad():
            own = torch.log_softmax(target(input_ids=s.input_ids[None]).logits[0].float(), -1)
        torch.testing.assert_close(own.gather(1, s.topk_ids), s.topk_logprobs, rtol=0, atol=2e-3)
