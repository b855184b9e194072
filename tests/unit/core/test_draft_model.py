"""The draft model: export keys/shapes, initialisation from target pieces, mask substitution, RoPE."""

from __future__ import annotations

import math

import pytest
import torch

from bench.reference_step import tiny_batch, tiny_draft, tiny_target_config
from peagle_pipeline.core.cod import CODConfig, build_layout
from peagle_pipeline.core.draft_config import DraftConfig
from peagle_pipeline.core.mask import dense_mask
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.core.rope import RopeSpec, rope_inv_freq
from peagle_pipeline.errors import BadInput

H, V = 64, 512


def _expected_keys(layers: int, mapped: bool) -> set[str]:
    keys = {
        "embed_tokens.weight",
        "fc.weight",
        "layers.0.hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "mask_hidden",
    }
    for i in range(layers):
        keys |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        keys |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        keys |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return keys | ({"d2t", "t2d"} if mapped else set())


def test_state_dict_keys_and_shapes_are_the_export_format():
    model, vocab, _ = tiny_draft(layers=2, draft_vocab=300)
    sd = model.state_dict()
    assert set(sd) == _expected_keys(2, mapped=True)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (2 * 32, 2 * H)  # fused layer: 2H inputs
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (32, 2 * H)
    assert sd["layers.1.self_attn.q_proj.weight"].shape == (64, H)
    assert sd["fc.weight"].shape == (H, 3 * H) and sd["mask_hidden"].shape == (1, 1, 3 * H)
    assert sd["lm_head.weight"].shape == (300, H) and sd["embed_tokens.weight"].shape == (V, H)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)
    identity, _, _ = tiny_draft(draft_vocab=V)
    assert set(identity.state_dict()) == _expected_keys(1, mapped=False)


def test_initialised_from_target_pieces_and_lm_head_frozen():
    model, vocab, pieces = tiny_draft(draft_vocab=300)
    assert torch.equal(model.embed_tokens.weight, pieces["embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, pieces["lm_head.weight"][vocab.ids])
    assert torch.equal(model.norm.weight, pieces["norm.weight"])
    assert not model.lm_head.weight.requires_grad and model.embed_tokens.weight.requires_grad
    a, _, _ = tiny_draft(seed=4)
    b, _, _ = tiny_draft(seed=4)
    assert torch.equal(a.fc.weight, b.fc.weight) and torch.equal(a.mask_hidden, b.mask_hidden)


def _row(seed=0, layers=1):
    model, vocab, _ = tiny_draft(seed=seed, layers=layers)
    tokens, aux, weight, _, _ = tiny_batch(seed, [20, 14], 40, V, 3 * H)
    lay = build_layout([20, 14], weight, CODConfig(depths=4), torch.Generator().manual_seed(seed))
    return model, lay, tokens, aux


def test_depth_ge1_uses_mask_token_and_mask_hidden_only():
    model, lay, tokens, aux = _row()
    N = len(lay)
    ids, is_mask = tokens[lay.target], lay.depth > 0
    aux_e, m = aux[lay.target], dense_mask(lay)
    base = model(ids, aux_e, is_mask, lay.position, m)
    g = torch.Generator().manual_seed(9)
    ids2 = torch.where(is_mask, torch.randint(0, V, (N,), generator=g), ids)
    aux2 = torch.where(is_mask[:, None], torch.randn(N, 3 * H, generator=g), aux_e)
    assert torch.allclose(model(ids2, aux2, is_mask, lay.position, m), base, atol=1e-6)
    # feeding the mask token and mask_hidden explicitly as "real" inputs gives the same result
    explicit_ids = torch.where(is_mask, torch.tensor(model.cfg.mask_token_id), ids)
    explicit_aux = torch.where(is_mask[:, None], model.mask_hidden.view(1, -1), aux_e)
    same = model(explicit_ids, explicit_aux, torch.zeros_like(is_mask), lay.position, m)
    assert torch.allclose(same, base, atol=1e-5)
    with torch.no_grad():
        model.mask_hidden.add_(1.0)
    moved = model(ids, aux_e, is_mask, lay.position, m)
    assert not torch.allclose(moved[is_mask], base[is_mask]) and torch.allclose(
        moved[~is_mask], base[~is_mask]
    )


def test_aux_index_and_out_index_paths_equal_the_plain_forward():
    model, lay, tokens, aux = _row(layers=2)
    m = dense_mask(lay)
    plain = model(tokens[lay.target], aux[lay.target], lay.depth > 0, lay.position, m)
    assert torch.allclose(model.forward_layout(lay, tokens, aux, m), plain, atol=1e-5)
    out = torch.tensor([3, 17, len(lay) - 1])
    part = model.forward_layout(lay, tokens, aux, m, out_index=out, out_mask=dense_mask(lay, out))
    assert torch.allclose(part, plain[out], atol=1e-5)


def test_grad_checkpointing_same_gradients_and_bf16_autocast_runs():
    model, lay, tokens, aux = _row(layers=2)
    m = dense_mask(lay)
    model.forward_layout(lay, tokens, aux, m).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.grad_checkpointing = True
    model.forward_layout(lay, tokens, aux, m).square().mean().backward()
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.forward_layout(lay, tokens, aux.bfloat16(), m)
        ref = model.forward_layout(lay, tokens, aux, m)
    assert bool(torch.isfinite(out).all()) and float((out.float() - ref).abs().mean()) < 0.1


def test_rope_matches_transformers():
    import transformers
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if int(transformers.__version__.split(".")[0]) < 5:  # our range admits 4.56+; this compares v5 configs
        pytest.skip(f"rope_parameters configs are transformers 5 API (found {transformers.__version__})")

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    hf = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        rope_parameters=params,
        max_position_embeddings=8192,
    )
    ours = rope_inv_freq(RopeSpec.from_config(hf.to_dict()), 64)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-6)
    legacy = RopeSpec.from_config({"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.theta == 1234.0 and legacy.rope_type == "linear" and legacy.factor == 2.0


# YaRN as real targets set it: gpt-oss (truncate off), Qwen3's long-context setting, DeepSeek's mscale pair.
YARN_TARGETS = {
    "gpt-oss": (
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
        4096,
        64,
    ),
    "qwen3-128k": ({"factor": 4.0, "rope_theta": 1000000.0}, 32768, 128),
    "mscale-pair": (
        {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
        4096,
        64,
    ),
}


@pytest.mark.parametrize("name", sorted(YARN_TARGETS))
def test_yarn_rope_matches_transformers(name: str):
    """The draft's YaRN frequencies and attention factor are transformers' (vLLM computes the same formula; the
    vLLM tier checks the served draft token for token), for the target's config and for the exported one."""
    import transformers
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"rope_parameters configs are transformers 5 API (found {transformers.__version__})")
    params, original, head_dim = YARN_TARGETS[name]
    params = {**params, "rope_type": "yarn", "original_max_position_embeddings": original}

    def hf_config(rope: dict) -> LlamaConfig:
        heads = 4
        return LlamaConfig(
            hidden_size=heads * head_dim,
            num_attention_heads=heads,
            head_dim=head_dim,
            rope_parameters=dict(rope),
            max_position_embeddings=original * int(params["factor"]),
        )

    target = hf_config(params)
    spec = RopeSpec.from_config(target.to_dict())
    theirs, attention = ROPE_INIT_FUNCTIONS["yarn"](target, "cpu")
    assert torch.equal(rope_inv_freq(spec, head_dim), theirs.float())
    assert spec.attention_factor == pytest.approx(attention, rel=1e-12) and spec.attention_factor != 1.0
    # the exported rope_parameters read back the same, by us and by transformers
    exported = hf_config(spec.as_config())
    assert RopeSpec.from_config(exported.to_dict()) == spec
    again, again_attention = ROPE_INIT_FUNCTIONS["yarn"](exported, "cpu")
    assert torch.equal(again, theirs) and again_attention == pytest.approx(attention, rel=1e-12)


# LongRoPE as Phi-3.5-mini (head_dim 96, all of it turning) and Phi-4-mini (head_dim 128, three quarters) set it:
# 4k original positions, 128k in all, short and long factor lists of one number per turning pair.
LONGROPE_TARGETS = {"phi-3.5-mini": (3072, 32, 1.0), "phi-4-mini": (3072, 24, 0.75)}


@pytest.mark.parametrize("name", sorted(LONGROPE_TARGETS))
def test_longrope_matches_transformers_short_factors_for_every_position(name: str):
    """The draft rotates as transformers rotates the target up to its original context (the short factors, the
    attention factor sqrt(1 + ln 32 / ln 4096)); the export writes that one list as both, so transformers and vLLM
    (which picks a list by the server's context) turn the draft's queries and keys the same at every length."""
    import transformers
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"rope_parameters configs are transformers 5 API (found {transformers.__version__})")
    hidden, heads, partial = LONGROPE_TARGETS[name]
    head_dim = hidden // heads
    pairs = int(head_dim * partial) // 2
    short = [1.0 + 0.05 * i for i in range(pairs)]
    long = [1.0 + 1.5 * i for i in range(pairs)]
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}
    target = Phi3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=8,
        partial_rotary_factor=partial,
        rope_parameters={**rope, "partial_rotary_factor": partial},
        original_max_position_embeddings=4096,
        max_position_embeddings=131072,
    )
    spec = RopeSpec.from_config(target.to_dict())
    theirs, attention = ROPE_INIT_FUNCTIONS["longrope"](target, "cpu")
    assert spec.rotary_dim(head_dim) == 2 * pairs and theirs.numel() == pairs
    assert torch.equal(rope_inv_freq(spec, head_dim), theirs.float())
    assert spec.attention_factor == pytest.approx(attention, rel=1e-12)
    assert spec.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    exported = spec.as_config(131072)
    assert exported["short_factor"] == exported["long_factor"] == short
    assert "short_mscale" not in exported  # vLLM derives the same factor from 131072 / 4096
    draft = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        head_dim=head_dim,
        rope_parameters=dict(exported),
        max_position_embeddings=131072,
    )
    assert RopeSpec.from_config(draft.to_dict()) == spec
    for seq_len in (None, 100_000):  # up to the original context and past it
        again, again_attention = ROPE_INIT_FUNCTIONS["longrope"](draft, "cpu", seq_len=seq_len)
        assert torch.equal(again, theirs) and again_attention == pytest.approx(attention, rel=1e-12)
    # a draft config with another context: vLLM would derive another factor, so the export names it for vLLM
    assert (
        spec.as_config(8192)["short_mscale"] == spec.as_config(8192)["long_mscale"] == spec.attention_factor
    )
    with pytest.raises(BadInput, match=f"not one per turning pair \\({pairs}\\)"):
        RopeSpec.from_config({**target.to_dict(), "rope_parameters": {**rope, "short_factor": short[1:]}})


def test_yarn_factor_and_original_length_as_transformers_derives_them():
    derived = RopeSpec.from_config(
        {
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "original_max_position_embeddings": 4096,
            },
        }
    )
    assert derived.factor == 8.0 and derived.attention_factor == pytest.approx(0.1 * math.log(8) + 1)
    # Phi-3 style: the top-level original length wins over the one in the rope parameters
    top = RopeSpec.from_config(
        {
            "original_max_position_embeddings": 2048,
            "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
        }
    )
    assert top.original_max_position_embeddings == 2048 and top.rope_type == "yarn"
    with pytest.raises(BadInput, match="longrope RoPE needs its short_factor and long_factor"):
        RopeSpec.from_config({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(BadInput, match="'dynamic' is not supported"):
        RopeSpec.from_config({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_gpt_oss_target_gives_a_draft_config():
    """gpt-oss (pipelines/gpt-oss-20b.yaml): YaRN RoPE and attention biases carried into the draft's layer."""
    from transformers import GptOssConfig

    target = GptOssConfig(num_hidden_layers=24).to_dict()
    cfg = DraftConfig.from_target_config(target, 1, 3, 32000, 200017)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2880, 64, 8, 64)
    assert cfg.attention_bias and cfg.rope.rope_type == "yarn" and not cfg.rope.truncate
    assert cfg.rope.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    layer = cfg.layer_config()
    assert layer["rope_parameters"]["attention_factor"] == cfg.rope.attention_factor
    assert layer["rope_parameters"]["original_max_position_embeddings"] == 4096


def test_config_from_target_and_bad_targets():
    cfg = DraftConfig.from_target_config(tiny_target_config(), 2, 3, 10**6, 5, True)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 2, 1, 32)
    assert cfg.draft_vocab_size == V and cfg.norm_before_residual and cfg.aux_size == 3 * H
    lc = cfg.layer_config()
    assert lc["num_hidden_layers"] == 2 and lc["num_aux_hidden_states"] == 3 and lc["vocab_size"] == V
    gelu = DraftConfig.from_target_config({**tiny_target_config(), "hidden_act": "gelu"}, 1, 3, 10, 5)
    assert gelu.layer_config()["hidden_act"] == "silu"  # the draft's MLP is SwiGLU whatever the target's
    with pytest.raises(BadInput):
        DraftConfig.from_target_config(tiny_target_config(), 1, 3, 10, V)  # mask id outside the vocabulary
    with pytest.raises(BadInput):
        PEagleDraft(cfg, {"embed_tokens.weight": torch.zeros(3, 3)}, None)


@pytest.mark.parametrize("yarn", [False, True], ids=["default-rope", "yarn"])
def test_qwen3_draft_layer_equals_transformers_qwen3_layer(yarn: bool):
    """With QK-norm a plain draft layer computes what a transformers Qwen3 decoder layer computes
    (per-head q/k RMS norms before RoPE), so the Qwen3 layer vLLM builds from the export matches training; with
    YaRN (Qwen3's long-context setting) the rotation and its attention factor too."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    target = {**tiny_target_config(), "model_type": "qwen3"}
    if yarn:  # a short original context, so that the ramp divides some pairs' frequencies
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        target = {**target, "rope_parameters": rope, "max_position_embeddings": 256}
    cfg = DraftConfig.from_target_config(
        target, num_layers=2, num_aux=3, draft_vocab_size=V, mask_token_id=500, qk_norm=True
    )
    assert cfg.layer_config()["model_type"] == "qwen3"
    model = PEagleDraft(cfg, None, None, generator=torch.Generator().manual_seed(0))
    ours = model.layers[1]  # a plain (not fused) layer
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):
            getattr(ours.self_attn, name).weight.uniform_(0.5, 1.5)
    hf_cfg = Qwen3Config(
        **{k: v for k, v in target.items() if k != "model_type"}, attn_implementation="eager"
    )
    hf = Qwen3DecoderLayer(hf_cfg, layer_idx=0)
    hf.load_state_dict(ours.state_dict())
    N = 9
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(N) * 29  # up to 232: past the YaRN case's original 64 positions
    cos, sin = model.rope(pos)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    with torch.no_grad():
        got = ours(x, None, cos, sin, causal)
        hf_cos, hf_sin = Qwen3RotaryEmbedding(hf_cfg)(x[None], pos[None])
        additive = torch.zeros(N, N).masked_fill(~causal, float("-inf"))[None, None]
        want = hf(x[None], attention_mask=additive, position_embeddings=(hf_cos, hf_sin))
        want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
