"""The layers of the draft: RMS norm, grouped-query attention with RoPE over COD elements, SwiGLU MLP,
and the pre-norm decoder layer (layer 0 the fused EAGLE-3 one, as vLLM's `llama_eagle3`).

Pure torch: no I/O, no global RNG (the draft model initialises every weight). Parameter names are those of the
exported weights (docs/reference/checkpoint-format.md), so a layer's `state_dict()` keys are the checkpoint's.

Worked example (SmolLM2-135M sizes: H = 576, 9 heads, 3 KV heads, head_dim 64, MLP 1536): the fused layer 0 takes
cat(input_layernorm(embeds), hidden_norm(fc(aux))) [N, 1152], so q_proj is [576, 1152], k_proj and v_proj
[192, 1152], o_proj [576, 576]; its residual is fc(aux) [N, 576]. A plain layer takes input_layernorm(stream)
[N, 576] (q_proj [576, 576]). Both return [N, 576].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peagle_pipeline.core.draft_config import DraftConfig
from peagle_pipeline.core.mask import AttnMask, attend

__all__ = ["RMSNorm", "Attention", "MLP", "DecoderLayer"]


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, weight applied in the input dtype (as transformers' LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of the first R dimensions. x: [N, heads, D]; cos, sin: [N, 1, R], R <= D (R < D:
    partial rotary, the last D - R dimensions pass through)."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((_rotate(x[..., :R], cos, sin), x[..., R:]), dim=-1)
    half = R // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over COD elements with the P-EAGLE mask."""

    def __init__(self, cfg: DraftConfig, in_size: int) -> None:
        super().__init__()
        D, bias = cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.q_proj = nn.Linear(in_size, cfg.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(in_size, cfg.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(in_size, cfg.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * D, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:  # Qwen3: per-head RMS norms of queries and keys, before RoPE
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [N, Hkv, D] of inputs x [N, in]."""
        N = x.shape[0]
        k = self.k_proj(x).view(N, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        k = _rotate(self.k_norm(k) if self.qk_norm else k, cos, sin)
        return k, self.v_proj(x).view(N, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttnMask,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: [Nq, in] query inputs; cos, sin: [Nq, 1, R] (R: the rotary dims); mask [Nq, Nk]; kv: keys/values of
        all Nk elements (default: computed from x, Nk = Nq). Returns [Nq, H]."""
        k, v = self.kv(x, cos, sin) if kv is None else kv
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)  # [Nq, Hq, D]
        q = _rotate(self.q_norm(q) if self.qk_norm else q, cos, sin)
        o = attend(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None].to(q.dtype),
            v.transpose(0, 1)[None].to(q.dtype),
            mask,
        )
        return self.o_proj(o[0].transpose(0, 1).reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Llama layer; layer 0 is the fused EAGLE-3 layer (2H attention input, `hidden_norm`)."""

    def __init__(self, cfg: DraftConfig, fused: bool) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.fused, self.norm_before_residual = fused, cfg.norm_before_residual
        if fused:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H if fused else H)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)

    def attn_input(
        self, stream: torch.Tensor, embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [N, 2H or H], residual [N, H]); stream = fc output for the fused layer."""
        if not self.fused:
            return self.input_layernorm(stream), stream
        assert embeds is not None
        normed = self.hidden_norm(stream)
        residual = normed if self.norm_before_residual else stream
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def kv(
        self, stream: torch.Tensor, embeds: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every element (used when only some queries are wanted)."""
        return self.self_attn.kv(self.attn_input(stream, embeds)[0], cos, sin)

    def forward(
        self,
        stream: torch.Tensor,
        embeds: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttnMask,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """stream: [Nq, H] (fc output for layer 0); embeds: [Nq, H] (layer 0 only); kv: keys/values of all
        elements when the queries are a subset. Returns [Nq, H]."""
        x, residual = self.attn_input(stream, embeds)
        h = residual + self.self_attn(x, cos, sin, mask, kv)
        return h + self.mlp(self.post_attention_layernorm(h))
