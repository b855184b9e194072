"""A target's tensors in the convention of the draft's (Llama) layers, for targets that store them otherwise.

Two conventions differ from Llama's in the Qwen3-family hybrids (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: linear
attention in most layers, gated full attention in every fourth), the first also in Gemma 1, 2 and 3:

- **Zero-centred RMS norms**: the layer computes rms_norm(x) * (1 + w), so a checkpoint stores w = 0 for unit
  scale. The draft's norms (and vLLM's Llama and Qwen3 layers) compute rms_norm(x) * w, so the same norm there has
  weight 1 + w. This holds for every norm these targets have: the final norm, the layers' input and
  post-attention norms, and the per-head q/k norms.
- **Gated attention output**: q_proj yields, per head, D query rows followed by D gate rows, and the attention
  output is multiplied by sigmoid(gate) before o_proj. The draft's attention has no gate; a start from such a layer
  takes the query rows and leaves the gate out, so it starts from that layer's attention without its gate (an
  approximation of the layer, where the other tensors are exact).

Fused projections (Phi-3, Phi-4) are split into Llama's: qkv_proj's rows are the query rows, then the keys', then
the values' ([(heads + 2 * kv_heads) * D, H]); gate_up_proj's are the gate's, then the up projection's ([2 * I, H]).

And a target MLP with another activation than silu (Gemma's gelu) has no counterpart in the draft's SwiGLU MLP: a
start from such a layer leaves its MLP out, as for a mixture of experts.

Scaled targets: Cohere multiplies its logits by `logit_scale`, Granite divides them by `logits_scaling`; the draft's
logits are lm_head(norm(h)), so the scale is folded into the final norm's weight (the start then gives the target's
logits, and `train --target exact` the target's distribution). Granite also scales its attention scores by
`attention_multiplier` instead of 1 / sqrt(D) and each residual branch by `residual_multiplier`: a start from its
layer folds the first into q_proj (x attention_multiplier x sqrt(D)) and the second into o_proj and down_proj.
A final LayerNorm (Cohere, StableLM, StarCoder2, Phi-MoE, Nemotron) subtracts the mean, which the draft's RMS norm
does not: `exact_target_refusal` says why such a target's exact log-probs cannot be computed.

Worked example: a zero-centred final norm stored as [0.0, -0.5, 0.25] is [1.0, 0.5, 1.25] for the draft; a Granite
final norm [1.0, 2.0] with logits_scaling 8 is [0.125, 0.25]. A gated
q_proj with 2 heads of D = 2 has rows [q0 q0 g0 g0 q1 q1 g1 g1] ([8, H]); its query rows are [q0 q0 q1 q1] ([4, H]).

Pure torch: no I/O.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ZERO_CENTRED_NORM_MODEL_TYPES",
    "GATED_ATTENTION_MODEL_TYPES",
    "pieces_in_draft_convention",
    "layer_in_draft_convention",
    "LAYER_NORM_MODEL_TYPES",
    "exact_target_refusal",
    "has_gated_attention",
    "has_rope",
    "logit_scale",
    "mlp_activation",
    "split_fused_projections",
]

# Target model types (of the language model: `text_config`'s for multimodal checkpoints) whose full-attention layers
# gate their output (transformers' Qwen3NextAttention, Qwen3_5Attention), and those whose RMS norms scale by 1 + w:
# these and Gemma 1-3's (GemmaRMSNorm; Gemma 3n's and Gemma 4's scale by w).
GATED_ATTENTION_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
ZERO_CENTRED_NORM_MODEL_TYPES = GATED_ATTENTION_MODEL_TYPES | {"gemma", "gemma2", "gemma3_text"}

# Target model types whose final norm is a LayerNorm (mean subtracted; Nemotron's scales by 1 + w), not an RMS norm.
LAYER_NORM_MODEL_TYPES = frozenset({"cohere", "cohere2", "stablelm", "starcoder2", "phimoe", "nemotron"})

_LAYER_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def _text_config(target_config: dict[str, Any]) -> dict[str, Any]:
    inner = target_config.get("text_config")
    return inner if isinstance(inner, dict) else target_config


def _model_type(target_config: dict[str, Any]) -> str | None:
    return _text_config(target_config).get("model_type")


def has_gated_attention(target_config: dict[str, Any]) -> bool:
    """Whether the target's full-attention layers gate their output (Qwen3-Next, Qwen3.5)."""
    return _model_type(target_config) in GATED_ATTENTION_MODEL_TYPES


def has_rope(target_config: dict[str, Any], layer: int) -> bool:
    """Whether the target's decoder layer `layer` rotates its queries and keys: not the layers that Llama 4's and
    SmolLM3's `no_rope_layers` mark 0 (every fourth)."""
    flags = _text_config(target_config).get("no_rope_layers")
    return not (isinstance(flags, list) and 0 <= layer < len(flags) and not flags[layer])


def mlp_activation(target_config: dict[str, Any]) -> str:
    """The activation of the target's MLP (`hidden_act`, or Gemma's `hidden_activation`; silu when unset)."""
    text = _text_config(target_config)
    return str(text.get("hidden_act") or text.get("hidden_activation") or "silu")


def _norm_offset(target_config: dict[str, Any]) -> float:
    return 1.0 if _model_type(target_config) in ZERO_CENTRED_NORM_MODEL_TYPES else 0.0


def logit_scale(target_config: dict[str, Any]) -> float:
    """What the target multiplies its logits by: Cohere's `logit_scale`, 1 / Granite's `logits_scaling`; 1 else."""
    text = _text_config(target_config)
    return float(text.get("logit_scale") or 1.0) / float(text.get("logits_scaling") or 1.0)


def exact_target_refusal(target_config: dict[str, Any]) -> str | None:
    """Why the target's log-probs cannot be computed as log_softmax(lm_head(rms_norm(h_L))) with the pieces in the
    draft's convention (a logit soft-cap, a final LayerNorm), or None when they can."""
    text = _text_config(target_config)
    if text.get("final_logit_softcapping"):
        return "soft-caps its logits (final_logit_softcapping)"
    if _model_type(target_config) in LAYER_NORM_MODEL_TYPES:
        return f"ends with a LayerNorm ({_model_type(target_config)}), not an RMS norm"
    return None


def pieces_in_draft_convention(
    pieces: dict[str, torch.Tensor], target_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The target pieces (embed_tokens.weight [V, H], lm_head.weight [V, H], norm.weight [H]) with the final norm's
    weight as the draft's RMS norm reads it and the target's logit scale folded in, so that lm_head(norm(h)) are
    the target's logits; the same dict for a Llama-convention target."""
    offset, scale = _norm_offset(target_config), logit_scale(target_config)
    if not offset and scale == 1.0:
        return pieces
    return {**pieces, "norm.weight": (pieces["norm.weight"].float() + offset) * scale}


def layer_in_draft_convention(
    tensors: dict[str, torch.Tensor], target_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """A stored target layer's tensors (Llama names, see `core.target_init`) as the draft's layer reads them: norms
    as rms_norm(x) * w; for a gated attention (q_proj [heads * 2 * D, H]), q_proj's query rows only
    ([heads * D, H]; heads and D = head_dim from the config); without the MLP's tensors when its activation is not
    silu; fused projections split (`split_fused_projections`). The same tensors for a Llama-convention target."""
    out = split_fused_projections(tensors, target_config)
    if mlp_activation(target_config) != "silu":
        out = {name: t for name, t in out.items() if not name.startswith("mlp.")}
    text = _text_config(target_config)
    num_heads = int(text.get("num_attention_heads") or 1)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // num_heads)
    offset = _norm_offset(target_config)
    if offset:
        for name in _LAYER_NORMS:
            if name in out:
                out[name] = out[name].float() + offset
    _fold_multipliers(out, text, head_dim)
    q = out.get("self_attn.q_proj.weight")
    if has_gated_attention(target_config) and q is not None and q.shape[0] == 2 * num_heads * head_dim:
        out["self_attn.q_proj.weight"] = q.view(num_heads, 2, head_dim, -1)[:, 0].reshape(
            num_heads * head_dim, -1
        )
        bias = out.get("self_attn.q_proj.bias")
        if bias is not None and bias.shape[0] == 2 * num_heads * head_dim:
            out["self_attn.q_proj.bias"] = bias.view(num_heads, 2, head_dim)[:, 0].reshape(-1)
    return out


def _fold_multipliers(tensors: dict[str, torch.Tensor], text: dict[str, Any], head_dim: int) -> None:
    """Granite's attention and residual multipliers folded into the layer's projections, in place (see the module
    docstring); nothing for a target without them."""
    scales = {}
    if text.get("attention_multiplier") is not None:
        scales["self_attn.q_proj"] = float(text["attention_multiplier"]) * head_dim**0.5
    if text.get("residual_multiplier") is not None:
        scales["self_attn.o_proj"] = scales["mlp.down_proj"] = float(text["residual_multiplier"])
    for proj, scale in scales.items():
        for kind in ("weight", "bias"):
            name = f"{proj}.{kind}"
            if name in tensors:
                tensors[name] = tensors[name].float() * scale


def split_fused_projections(
    tensors: dict[str, torch.Tensor], target_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """A layer's tensors with a fused `self_attn.qkv_proj.weight` and `mlp.gate_up_proj.weight` split into Llama's
    q/k/v and gate/up projections (heads, kv heads and D = head_dim from the config); the same tensors otherwise.

    Example: 2 heads, 1 kv head, D = 2: qkv_proj rows [q q q q k k v v] ([8, H]) give q_proj [4, H], k_proj and
    v_proj [2, H] each.
    """
    out = dict(tensors)
    text = _text_config(target_config)
    num_heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or num_heads)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // num_heads)
    qkv = out.pop("self_attn.qkv_proj.weight", None)
    if qkv is not None:
        q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        out.update(
            {f"self_attn.{n}_proj.weight": t.contiguous() for n, t in zip("qkv", (q, k, v), strict=True)}
        )
    gate_up = out.pop("mlp.gate_up_proj.weight", None)
    if gate_up is not None:
        gate, up = gate_up.chunk(2)
        out.update({"mlp.gate_proj.weight": gate.contiguous(), "mlp.up_proj.weight": up.contiguous()})
    return out
