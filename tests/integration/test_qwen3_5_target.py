"""A Qwen3.5 target end to end, as Qwen3.5 ships: a multimodal checkpoint (Qwen3_5ForConditionalGeneration, the
language model under `text_config` and `model.language_model.*`) whose layers are linear attention but for every
fourth, a gated full attention with partial rotary and zero-centred norms. Extracted (HF backend), trained and
exported with the real CLI; the vLLM tier serves a Qwen3-Next draft (tests/vllm).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_run import peagle
from tiny import write_conversations

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_5_run(tiny_qwen3_5: Path, tmp_path_factory) -> Path:
    """A 2-step run on a Qwen3.5 cache with last hidden states (3 aux layers, K=3), exported to RUN/export; its
    terminal in RUN/output.txt."""
    tmp = tmp_path_factory.mktemp("qwen3-5-run")
    data = write_conversations(tmp / "conv.jsonl", 16)
    cache, run = tmp / "cache", tmp / "run"
    peagle(
        *["extract", "--model", str(tiny_qwen3_5), "--data", str(data), "--output", str(cache)],
        *["--dtype", "fp32", "--max-length", "256", "--shard-tokens", "2048", "--layers", "0,1,2"],
        "--last-hidden",
    )
    proc = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *["--steps", "2", "--eval-every", "2", "--save-every", "2", "--eval-samples", "4"],
        *["--precision", "fp32", "--num-workers", "0", "--target", "exact"],
    )
    (run / "output.txt").write_text(proc.stdout + proc.stderr)
    return run


def test_the_export_is_a_qwen3_layer_that_rotates_a_quarter_of_each_head(qwen3_5_run: Path) -> None:
    out = (qwen3_5_run / "output.txt").read_text()
    assert "held-out: loss" in out  # trained on the exact target, evaluated and exported
    assert "starts from target layer 3 with its q_norm/k_norm, without its attention's output gate" in out
    layer = json.loads((qwen3_5_run / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert (layer["hidden_size"], layer["eos_token_id"]) == (64, 2)  # from text_config


def test_the_final_norm_reproduces_the_targets_log_probs(qwen3_5_run: Path) -> None:
    """The exact target (the stored last hidden state through the final norm and lm_head, as `train --target
    exact` computes it) gives the log-probs the target itself gave: the zero-centred norm is read as 1 + w."""
    from peagle_pipeline.cache.reader import open_cache

    cache = open_cache(str(qwen3_5_run.parent / "cache"))
    pieces = cache.target_pieces()
    eps = cache.target_config()["text_config"]["rms_norm_eps"]
    s = cache.read_sample(0)
    h = s.last_hidden.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * pieces["norm.weight"].float()
    logprobs = torch.log_softmax(normed @ pieces["lm_head.weight"].float().T, -1)
    torch.testing.assert_close(logprobs.gather(1, s.topk_ids), s.topk_logprobs, rtol=0, atol=2e-3)
