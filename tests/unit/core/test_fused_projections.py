"""Phi-3 / Phi-4 targets fuse q, k, v into one qkv_proj and gate, up into one gate_up_proj: split into Llama's, a draft
started from such a layer is that layer (checked against transformers' own Phi3DecoderLayer)."""

from __future__ import annotations

import pytest
import torch
from layer_compare import draft_and_target_layer, random_decoder_layer

from bench.reference_step import tiny_target_config
from peagle_pipeline.core.draft_config import DraftConfig
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.core.target_convention import split_fused_projections
from peagle_pipeline.core.target_init import init_from_target_layer

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:  # our range admits 4.56+; the layer API compared is v5's
    pytest.skip(
        f"compares transformers 5 modules (found {transformers.__version__})", allow_module_level=True
    )


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_a_draft_started_from_a_fused_layer_is_that_layer(rope: str):
    """Phi-3-mini-4k's plain RoPE, and Phi-4-mini's LongRoPE over three quarters of each head (4k original positions,
    128k in all): the draft rotates as the target does within the original context."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding

    base = tiny_target_config()
    head_dim = base["hidden_size"] // base["num_attention_heads"]
    pairs = int(head_dim * 0.75) // 2
    longrope = dict(
        partial_rotary_factor=0.75,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.3 * i for i in range(pairs)],
            "long_factor": [1.0 + 2.0 * i for i in range(pairs)],
        },
        original_max_position_embeddings=4096,
        max_position_embeddings=131072,
    )
    layer, config = random_decoder_layer(
        Phi3Config,
        Phi3DecoderLayer,
        **(longrope if rope == "longrope" else {"max_position_embeddings": 4096}),
    )
    target, H = config.to_dict(), config.hidden_size
    tensors = split_fused_projections(dict(layer.state_dict()), target)
    assert "self_attn.qkv_proj.weight" not in tensors and "mlp.gate_up_proj.weight" not in tensors
    D = H // config.num_attention_heads
    assert tensors["self_attn.k_proj.weight"].shape == (config.num_key_value_heads * D, H)
    cfg = DraftConfig.from_target_config(target, 1, 3, config.vocab_size, 500)
    assert cfg.rope.rope_type == rope and (cfg.rope.attention_factor > 1.19) == (rope == "longrope")
    model = PEagleDraft(cfg, None, None, generator=torch.Generator().manual_seed(0))
    init_from_target_layer(model, tensors)
    ours, theirs = draft_and_target_layer(model, layer, Phi3RotaryEmbedding(config), config.vocab_size, H)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_fused_checkpoint_layer_is_read_split(tmp_path):
    """What `extract` stores for the start (target_weights.load_target_pieces_from_model: the fused tensors as they are)
    reads back through the draft's convention as Llama's projections, whose rows put together are the fused ones."""
    from safetensors.torch import load_file
    from transformers import Phi3Config, Phi3ForCausalLM

    from peagle_pipeline.cache.layout import LAYER_PIECE_PREFIX
    from peagle_pipeline.core.target_convention import layer_in_draft_convention
    from peagle_pipeline.target_weights import load_target_pieces_from_model

    config = Phi3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    Phi3ForCausalLM(config).save_pretrained(str(tmp_path))
    pieces = load_target_pieces_from_model(tmp_path, init_layer=1)
    stored = {k[len(LAYER_PIECE_PREFIX) :]: v for k, v in pieces.items() if k.startswith(LAYER_PIECE_PREFIX)}
    assert {"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"} <= set(stored)
    layer = layer_in_draft_convention(stored, config.to_dict())
    assert "self_attn.qkv_proj.weight" not in layer and "mlp.gate_up_proj.weight" not in layer
    saved = load_file(str(tmp_path / "model.safetensors"))
    qkv = torch.cat([layer[f"self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, saved["model.layers.1.self_attn.qkv_proj.weight"])
    gate_up = torch.cat([layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"]])
    assert torch.equal(gate_up, saved["model.layers.1.mlp.gate_up_proj.weight"])
    assert layer["self_attn.k_proj.weight"].shape == (32, 64)
