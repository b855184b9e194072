"""A gpt-oss target end to end (pipelines/gpt-oss-20b.yaml's architecture): a tiny random GptOssForCausalLM with
YaRN RoPE, mixture-of-experts MLPs and attention biases, extracted, trained and exported with the real CLI.

The draft layer is a Llama layer with the target's RoPE (YaRN, written out in full in the export) and attention
biases; the target's last layer is not Llama-style (its MLP is a mixture of experts), so the draft starts random.
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
def gpt_oss_run(tiny_gpt_oss: Path, tmp_path_factory) -> Path:
    """A 2-step run on a gpt-oss cache (3 aux layers, K=3), exported to RUN/export; its terminal in RUN/output.txt."""
    tmp = tmp_path_factory.mktemp("gpt-oss-run")
    data = write_conversations(tmp / "conv.jsonl", 24)
    cache, run = tmp / "cache", tmp / "run"
    peagle(
        *["extract", "--model", str(tiny_gpt_oss), "--data", str(data), "--output", str(cache)],
        *["--dtype", "fp32", "--max-length", "256", "--shard-tokens", "2048", "--layers", "0,1,2"],
    )
    proc = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *["--steps", "2", "--eval-every", "2", "--save-every", "2", "--eval-samples", "4"],
        *["--precision", "fp32", "--num-workers", "0"],
    )
    (run / "output.txt").write_text(proc.stdout + proc.stderr)
    return run


def test_the_draft_rotates_as_the_target_does(gpt_oss_run: Path, tiny_gpt_oss: Path) -> None:
    """The exported rope_parameters give transformers the target's own YaRN frequencies and attention factor."""
    from transformers import AutoConfig, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    layer = json.loads((gpt_oss_run / "export" / "config.json").read_text())["transformer_layer_config"]
    rope = layer["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["truncate"] is False
    target_freq, target_factor = ROPE_INIT_FUNCTIONS["yarn"](
        AutoConfig.from_pretrained(str(tiny_gpt_oss)), "cpu"
    )
    draft = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})
    draft_freq, draft_factor = ROPE_INIT_FUNCTIONS["yarn"](draft, "cpu")
    assert torch.equal(draft_freq, target_freq)
    assert draft_factor == pytest.approx(target_factor, rel=1e-12) and draft_factor > 1.2


def test_attention_biases_are_trained_and_exported(gpt_oss_run: Path) -> None:
    from safetensors.torch import load_file

    layer = json.loads((gpt_oss_run / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["attention_bias"] is True and layer["model_type"] == "llama"
    weights = load_file(str(gpt_oss_run / "export" / "model.safetensors"))
    heads, kv_heads, D, H = (
        layer[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
    )
    shapes = {
        name: tuple(weights[f"layers.0.self_attn.{name}.bias"].shape)
        for name in ("q_proj", "k_proj", "o_proj")
    }
    assert shapes == {"q_proj": (heads * D,), "k_proj": (kv_heads * D,), "o_proj": (H,)}


def test_the_draft_starts_from_the_last_layers_attention(gpt_oss_run: Path, tiny_gpt_oss: Path) -> None:
    """The last layer's MLP is a mixture of experts: its attention (biases included) and norms start the fused
    layer, whose MLP starts at zero output."""
    from safetensors.torch import load_file

    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.config import TrainConfig, resolve
    from peagle_pipeline.stages.train.draft import build_draft

    out = (gpt_oss_run / "output.txt").read_text()
    assert "draft layer 0 starts from target layer 3's attention (its MLP is a mixture of experts" in out
    assert "held-out: loss" in out  # the run trained, evaluated and exported
    cache = open_cache(str(gpt_oss_run.parent / "cache"))
    cfg = resolve(
        TrainConfig, None, {"cache": str(cache.path), "output": str(gpt_oss_run.parent / "new-run")}
    )
    model, _, _ = build_draft(cache, cfg)
    target = load_file(str(tiny_gpt_oss / "model.safetensors"))
    first = model.layers[0]
    H = model.cfg.hidden_size
    assert torch.equal(
        first.self_attn.q_proj.weight[:, H:].detach(), target["model.layers.3.self_attn.q_proj.weight"]
    )
    assert torch.equal(first.self_attn.o_proj.bias.detach(), target["model.layers.3.self_attn.o_proj.bias"])
    assert not first.mlp.down_proj.weight.any()
