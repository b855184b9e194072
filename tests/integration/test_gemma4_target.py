"""A Gemma 4 target end to end (text only): gelu MLPs, norms after attention and MLP as well as before them, one RoPE
per layer type, soft-capped logits. Its layers are not Llama ones, so the draft (a Llama layer, SwiGLU) starts from
random weights, and takes the full-attention layers' RoPE base; extracted, trained and exported with the real CLI
(the vLLM tier checks its proposals token for token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import peagle
from tiny import write_conversations

pytestmark = pytest.mark.slow


def test_a_gemma4_target_trains_from_random_weights_and_exports(tiny_gemma4: Path, tmp_path: Path) -> None:
    data = write_conversations(tmp_path / "conv.jsonl", 16)
    cache, run = tmp_path / "cache", tmp_path / "run"
    peagle(
        *[
            "extract",
            "--model",
            str(tiny_gemma4),
            "--data",
            str(data),
            "--output",
            str(cache),
            "--last-hidden",
        ],
        *["--dtype", "fp32", "--max-length", "256", "--shard-tokens", "2048", "--layers", "0,1,2"],
    )
    train = [
        *["train", "--cache", str(cache), "--depths", "3", "--tokens-per-step", "256", "--steps", "2"],
        *["--eval-every", "2", "--save-every", "2", "--eval-samples", "4", "--precision", "fp32"],
        *["--num-workers", "0"],
    ]
    refused = peagle(*train, "--output", str(tmp_path / "exact"), "--target", "exact", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "this target soft-caps its logits (final_logit_softcapping): use target=topk" in refused.stderr
    proc = peagle(*train, "--output", str(run))
    out = proc.stdout + proc.stderr
    assert "stores no target layer to start the draft from: random initialisation" in out
    assert "held-out: loss" in out  # trained, evaluated and exported
    layer = json.loads((run / "export" / "config.json").read_text())["transformer_layer_config"]
    assert (layer["model_type"], layer["hidden_act"]) == ("llama", "silu")
    assert layer["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 1000000.0,
    }  # full attention's base
