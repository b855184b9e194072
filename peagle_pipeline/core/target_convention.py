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

Worked example: a zero-centred final norm stored as [0.0, -0.5, 0.25] is [1.0, 0.5, 1.25] for the draft. A gated
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
    "has_gated_attention",
    "mlp_activation",
    "split_fused_projections",
]

# Target model types (of the language model: `text_config`'s for multimodal checkpoints) whose full-attention layers
# gate their output (transformers' Qwen3NextAttention, Qwen3_5Attention), and those whose RMS norms scale by 1 + w:
# these and Gemma 1-3's (GemmaRMSNorm; Gemma 3n's and Gemma 4's scale by w).
GATED_ATTENTION_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
ZERO_CENTRED_NORM_MODEL_TYPES = GATED_ATTENTION_MODEL_TYPES | {"gemma", "gemma2", "gemma3_text"}

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


def mlp_activation(target_config: dict[str, Any]) -> str:
    """The activation of the target's MLP (`hidden_act`, or Gemma's `hidden_activation`; silu when unset)."""
    text = _text_config(target_config)
    return str(text.get("hidden_act") or text.get("hidden_activation") or "silu")


def _norm_offset(target_config: dict[str, Any]) -> float:
    return 1.0 if _model_type(target_config) in ZERO_CENTRED_NORM_MODEL_TYPES else 0.0


def pieces_in_draft_convention(
    pieces: dict[str, torch.Tensor], target_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The target pieces (embed_tokens.weight [V, H], lm_head.weight [V, H], norm.weight [H]) with the final norm's
    weight as the draft's RMS norm reads it; the same dict when the target's norms are Llama ones."""
    offset = _norm_offset(target_config)
    if not offset:
        return pieces
    return {**pieces, "norm.weight": pieces["norm.weight"].float() + offset}


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
    q = out.get("self_attn.q_proj.weight")
    if has_gated_attention(target_config) and q is not None and q.shape[0] == 2 * num_heads * head_dim:
        out["self_attn.q_proj.weight"] = q.view(num_heads, 2, head_dim, -1)[:, 0].reshape(
            num_heads * head_dim, -1
        )
        bias = out.get("self_attn.q_proj.bias")
        if bias is not None and bias.shape[0] == 2 * num_heads * head_dim:
            out["self_attn.q_proj.bias"] = bias.view(num_heads, 2, head_dim)[:, 0].reshape(-1)
    return out


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
