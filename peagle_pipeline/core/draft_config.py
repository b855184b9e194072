"""The draft's sizes and settings: `DraftConfig`, read from the target's HF config dict, and the
`transformer_layer_config` it exports.

Pure: no I/O, no torch. Sizes, heads, head_dim, MLP size, norm eps and RoPE are the target's; the number of
layers, of aux states, the draft vocabulary and the mask token are the run's. Targets with Qwen3's QK-norm get
Qwen3 layers (`has_qk_norm`). The MLP is SwiGLU (silu) whatever the target's activation: vLLM's Llama and Qwen3
draft layers take no other.

Worked example (SmolLM2-135M: hidden 576, 9 heads, 3 KV heads, MLP 1536, V = 49152), one layer, 3 aux states,
draft vocabulary 32000: head_dim = 576 / 9 = 64, aux_size = 3 * 576 = 1728 (fc input), lm_head has
min(32000, 49152) = 32000 rows, and `layer_config()` is a LlamaForCausalLM config with num_hidden_layers 1 and
num_aux_hidden_states 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peagle_pipeline.core.rope import RopeSpec
from peagle_pipeline.errors import BadInput

__all__ = ["DraftConfig", "QK_NORM_MODEL_TYPES", "has_qk_norm"]


# Target model types whose attention normalises queries and keys per head (q_norm / k_norm): their draft layers are
# Qwen3 layers, the architecture vLLM's P-EAGLE loader accepts besides Llama. Qwen3-Next and Qwen3.5 (the language
# model's type under `text_config`) have them in their full-attention layers.
QK_NORM_MODEL_TYPES = frozenset(
    {
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "qwen3_vl_text",
        "qwen3_vl_moe_text",
    }
)


# Target model types whose attention has query/key/value biases that their config does not name (Qwen2's are built
# in; Qwen2-MoE says `qkv_bias`). Their drafts get attention biases: vLLM's P-EAGLE layer has them on q, k, v and o
# together, and o's starts at zero, so a draft started from the target's layer computes exactly that layer.
QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text"})


def has_qk_norm(target_config: dict[str, Any]) -> bool:
    """Whether a target (HF config dict) has Qwen3's QK-norm, so its draft gets Qwen3 layers."""
    cfg = target_config.get("text_config") or target_config
    return cfg.get("model_type") in QK_NORM_MODEL_TYPES


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """Sizes and settings of the draft; built from the target's HF config dict."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    """V: target vocabulary (embedding rows)."""
    draft_vocab_size: int
    """Vd <= V: lm_head rows."""
    num_layers: int
    num_aux: int
    """Aux hidden states concatenated per token (fc input = num_aux * target_hidden_size)."""
    mask_token_id: int
    norm_before_residual: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    target_hidden_size: int = 0
    """Hidden size of the target's aux states (0 = hidden_size)."""
    rope: RopeSpec = field(default_factory=RopeSpec)
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    qk_norm: bool = False
    """Qwen3 architecture: RMS norms over head_dim on queries and keys before RoPE (`q_norm`, `k_norm`); exported
    as a Qwen3 `transformer_layer_config`, which vLLM loads as `PeagleQwen3ForCausalLM`."""

    @property
    def aux_size(self) -> int:
        """Width of the concatenated aux states (fc input)."""
        return self.num_aux * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_target_config(
        cls,
        target_config: dict[str, Any],
        num_layers: int,
        num_aux: int,
        draft_vocab_size: int,
        mask_token_id: int,
        norm_before_residual: bool = False,
        qk_norm: bool = False,
    ) -> DraftConfig:
        """Take sizes, heads, head_dim, MLP size, norm eps and RoPE from the target config dict; `qk_norm` makes
        the layers Qwen3 ones (see `has_qk_norm` for which targets have them).

        Raises:
            BadInput: missing sizes, an unsupported activation or RoPE, or out-of-range ids.
        """
        cfg = dict(target_config.get("text_config") or target_config)
        try:
            H, heads, V = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as err:
            raise BadInput(f"target config lacks {err.args[0]!r}") from None
        if num_layers < 1 or num_aux < 1:
            raise BadInput(f"draft needs >= 1 layer and >= 1 aux state, got {num_layers} and {num_aux}")
        if not 0 <= mask_token_id < V:
            raise BadInput(f"mask_token_id {mask_token_id} is outside the target vocabulary of {V}")
        return cls(
            hidden_size=H,
            intermediate_size=inter,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or H // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=V,
            draft_vocab_size=min(int(draft_vocab_size), V),
            num_layers=int(num_layers),
            num_aux=int(num_aux),
            mask_token_id=int(mask_token_id),
            norm_before_residual=bool(norm_before_residual),
            attention_bias=bool(
                cfg.get("attention_bias")
                or cfg.get("qkv_bias")
                or cfg.get("model_type") in QKV_BIAS_MODEL_TYPES
            ),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            target_hidden_size=H,
            rope=RopeSpec.from_config(cfg),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            qk_norm=bool(qk_norm),
        )

    def layer_config(self) -> dict[str, Any]:
        """A Llama (or, with `qk_norm`, Qwen3) HF config dict of the draft (the export's `transformer_layer_config`)."""
        return {
            "architectures": ["Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM"],
            "model_type": "qwen3" if self.qk_norm else "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_layers,
            "num_aux_hidden_states": self.num_aux,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": self.rope.as_config(self.max_position_embeddings),
            "rope_theta": self.rope.theta,
            "tie_word_embeddings": False,
            "initializer_range": self.initializer_range,
        }
