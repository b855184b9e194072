"""`train --target exact` on targets that are not Llama at the end: Granite (logits divided by logits_scaling) gets
its own log-probs from the cache's last hidden states; a final LayerNorm (StableLM) is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_run import peagle
from tiny import build_tiny_causal_lm, write_conversations

pytestmark = pytest.mark.slow

TRAIN = [
    *["--depths", "3", "--tokens-per-step", "256", "--steps", "2", "--eval-every", "2", "--save-every", "2"],
    *["--eval-samples", "4", "--precision", "fp32", "--num-workers", "0", "--target", "exact"],
]


def _extract(model: Path, tmp_path: Path) -> Path:
    data = write_conversations(tmp_path / "conv.jsonl", 12)
    cache = tmp_path / "cache"
    peagle(
        *["extract", "--model", str(model), "--data", str(data), "--output", str(cache), "--last-hidden"],
        *["--dtype", "fp32", "--max-length", "256", "--layers", "0,1,2"],
    )
    return cache


def test_the_exact_target_of_a_granite_is_its_own_distribution(tiny_granite: Path, tmp_path: Path) -> None:
    """What the trainer computes the exact target from (the cache's pieces: the logit divisor folded into the final
    norm) reproduces the stored log-probs; read without it they are 16 times too sharp (1.9 nats off here)."""
    from peagle_pipeline.cache.reader import open_cache

    cache = _extract(tiny_granite, tmp_path)
    proc = peagle("train", "--cache", str(cache), "--output", str(tmp_path / "run"), *TRAIN)
    out = proc.stdout + proc.stderr
    assert "held-out: loss" in out and "draft layer 0 starts from target layer 3;" in out
    reader = open_cache(str(cache))
    pieces = reader.target_pieces()
    for sample_id in (0, 3):
        s = reader.read_sample(sample_id)
        h = s.last_hidden.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * pieces["norm.weight"].float()
        logprobs = torch.log_softmax(normed @ pieces["lm_head.weight"].float().T, -1)
        torch.testing.assert_close(logprobs.gather(1, s.topk_ids), s.topk_logprobs, rtol=0, atol=2e-3)


def test_the_exact_target_of_a_target_ending_with_a_layernorm_is_refused(tmp_path: Path) -> None:
    cache = _extract(build_tiny_causal_lm(tmp_path / "stablelm", "stablelm"), tmp_path)
    refused = peagle("train", "--cache", str(cache), "--output", str(tmp_path / "run"), *TRAIN, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: target=exact computes the target's log-probs as lm_head(rms_norm(last hidden state)), and this "
        "target ends with a LayerNorm (stablelm), not an RMS norm: use target=topk"
    )
    assert not (tmp_path / "run" / "export").exists()
