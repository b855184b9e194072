"""Qwen3-Next and Qwen3.5 targets (gated full attention with partial rotary and zero-centred norms between linear
attention layers): the draft rotates as they do, and a draft started from their last layer is, but for the output
gate it leaves out, that layer (both checked against transformers' own Qwen3-Next modules). And the other targets
`core.target_convention` and `core.rope` take in: a gelu MLP left out of the start, a RoPE per layer type (Gemma 4)."""

from __future__ import annotations

import pytest
import torch
from layer_compare import draft_and_target_layer

from bench.reference_step import tiny_target_config
from peagle_pipeline.core.draft_config import DraftConfig, has_qk_norm
from peagle_pipeline.core.draft_layers import _rotate
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.core.rope import RopeSpec, rope_inv_freq
from peagle_pipeline.core.target_convention import (
    layer_in_draft_convention,
    mlp_activation,
    pieces_in_draft_convention,
)
from peagle_pipeline.core.target_init import init_from_target_layer

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:  # our range admits 4.56+; Qwen3-Next's layer API is v5's
    pytest.skip(
        f"compares transformers 5 modules (found {transformers.__version__})", allow_module_level=True
    )


def _qwen3_next_config():
    """A one-layer Qwen3-Next whose layer is full attention with a dense MLP (partial rotary 0.25 by default)."""
    from transformers import Qwen3NextConfig

    base = tiny_target_config()
    config = Qwen3NextConfig(
        **{k: base[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")},
        num_key_value_heads=base["num_key_value_heads"],
        head_dim=base["head_dim"],
        num_hidden_layers=1,
        layer_types=["full_attention"],
        mlp_only_layers=[0],
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "eager"
    return config


def test_partial_rotary_turns_the_heads_first_dims_as_transformers():
    """Qwen3-Next's rotation (a quarter of each head turns): our frequencies and rotation are transformers', and
    the exported rope_parameters read back the same."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = _qwen3_next_config()
    spec = RopeSpec.from_config(config.to_dict())
    assert spec.partial_rotary_factor == 0.25 and spec.rotary_dim(32) == 8
    exported = {
        "rope_parameters": spec.as_config(),
        "max_position_embeddings": config.max_position_embeddings,
    }
    assert RopeSpec.from_config(exported) == spec
    rope = Qwen3NextRotaryEmbedding(config)
    torch.testing.assert_close(rope_inv_freq(spec, 32), rope.inv_freq.float(), rtol=0, atol=0)
    pos = torch.arange(7) * 13
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 7, 32, generator=g), torch.randn(1, 1, 7, 32, generator=g)
    cos, sin = rope(q, pos[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    freqs = pos.float()[:, None] * rope_inv_freq(spec, 32)[None]
    ours_cos, ours_sin = (
        torch.cat([freqs, freqs], -1).cos()[:, None],
        torch.cat([freqs, freqs], -1).sin()[:, None],
    )
    torch.testing.assert_close(_rotate(q[0].transpose(0, 1), ours_cos, ours_sin), want_q[0].transpose(0, 1))
    torch.testing.assert_close(_rotate(k[0].transpose(0, 1), ours_cos, ours_sin), want_k[0].transpose(0, 1))
    assert torch.equal(
        _rotate(q[0].transpose(0, 1), ours_cos, ours_sin)[..., 8:], q[0].transpose(0, 1)[..., 8:]
    )


def test_a_draft_started_from_a_gated_layer_is_that_layer_without_its_gate():
    """The target layer with its gate rows at zero (sigmoid 0.5 on every channel) equals the started draft with
    o_proj halved: the zero-centred norms (input, post-attention, q, k), the query rows taken from the interleaved
    q_proj, the partial rotation and the MLP all carry over exactly."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextDecoderLayer,
        Qwen3NextRotaryEmbedding,
    )

    config = _qwen3_next_config()
    target = config.to_dict()
    heads, D, H = config.num_attention_heads, config.head_dim, config.hidden_size
    torch.manual_seed(0)
    layer = Qwen3NextDecoderLayer(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)  # norms near 0: zero-centred, so near unit scale
        layer.self_attn.q_proj.weight.view(heads, 2, D, H)[:, 1] = 0  # the gate rows: sigmoid(0) = 1/2
    tensors = layer_in_draft_convention(dict(layer.state_dict()), target)
    assert tensors["self_attn.q_proj.weight"].shape == (heads * D, H)
    assert has_qk_norm(target)
    cfg = DraftConfig.from_target_config(target, 1, 3, config.vocab_size, 500, qk_norm=True)
    model = PEagleDraft(cfg, None, None, generator=torch.Generator().manual_seed(0))
    init_from_target_layer(model, tensors)
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight.mul_(0.5)
    ours, theirs = draft_and_target_layer(
        model, layer, Qwen3NextRotaryEmbedding(config), config.vocab_size, H
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_zero_centred_final_norm_and_llama_targets_unchanged():
    """The docstring's example: a Qwen3-Next final norm stored as w is 1 + w for the draft; a Llama target's pieces
    are returned as they are; a Qwen3.5 checkpoint (multimodal: the language model under text_config) counts too."""
    stored = {"embed_tokens.weight": torch.zeros(2, 3), "lm_head.weight": torch.zeros(2, 3)}
    stored["norm.weight"] = torch.tensor([0.0, -0.5, 0.25])
    qwen35 = {
        "model_type": "qwen3_5",
        "text_config": {"model_type": "qwen3_5_text", "num_attention_heads": 2},
    }
    for config in ({"model_type": "qwen3_next"}, qwen35):
        assert pieces_in_draft_convention(stored, config)["norm.weight"].tolist() == [1.0, 0.5, 1.25]
    assert pieces_in_draft_convention(stored, tiny_target_config()) is stored
    q = torch.arange(8.0)[:, None].expand(8, 3)  # 2 heads of D = 2: rows q q g g q q g g
    gated = layer_in_draft_convention(
        {"self_attn.q_proj.weight": q}, {**qwen35["text_config"], "head_dim": 2}
    )
    assert gated["self_attn.q_proj.weight"][:, 0].tolist() == [0.0, 1.0, 4.0, 5.0]
    plain = layer_in_draft_convention({"self_attn.q_proj.weight": q}, tiny_target_config())
    assert plain["self_attn.q_proj.weight"] is q


def test_a_gelu_mlp_is_left_out_and_a_rope_per_layer_type_gives_the_full_attention_base():
    """Gemma's MLP (gelu) has no counterpart in the draft's SwiGLU: a start leaves it out (the draft's MLP then
    starts silent, as for a mixture of experts). Gemma 4's RoPE per layer type: the draft's is the default rotation
    over the whole head at the full-attention layers' base."""
    tensors = {"mlp.up_proj.weight": torch.ones(2, 2), "input_layernorm.weight": torch.ones(2)}
    gemma = {"model_type": "gemma4_text", "hidden_activation": "gelu_pytorch_tanh", "num_attention_heads": 2}
    assert mlp_activation(gemma) == "gelu_pytorch_tanh" and mlp_activation(tiny_target_config()) == "silu"
    assert set(layer_in_draft_convention(tensors, gemma)) == {"input_layernorm.weight"}
    assert set(layer_in_draft_convention(tensors, tiny_target_config())) == set(tensors)
    per_type = {
        "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    spec = RopeSpec.from_config({"rope_parameters": per_type, "max_position_embeddings": 4096})
    assert (spec.rope_type, spec.theta, spec.partial_rotary_factor) == ("default", 1e6, 1.0)
