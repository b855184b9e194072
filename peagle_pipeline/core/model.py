"""The P-EAGLE draft model (SPEC §5.3), built from the target's config dict and its saved pieces.

Pure torch: no I/O, never loads the target model, no global RNG (initialisation takes a `torch.Generator`).
Matches vLLM's `llama_eagle3` runtime: fused layer 0 sees cat(input_layernorm(embeds), hidden_norm(fc(aux)))
with residual fc(aux) (or the normed hidden with `norm_before_residual`), plain pre-norm Llama layers after,
a final norm, and logits from a frozen lm_head over the draft vocabulary. Depth >= 1 elements get
`mask_token_id` as token and `mask_hidden` as aux states (before `fc`, as vLLM's combine_hidden_states does).
`state_dict()` keys are exactly the exported weight names of SPEC §6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from peagle_pipeline.core.cod import CODLayout
from peagle_pipeline.core.mask import AttnMask, attend
from peagle_pipeline.core.vocab import DraftVocab
from peagle_pipeline.errors import BadInput

__all__ = [
    "RopeSpec",
    "DraftConfig",
    "RMSNorm",
    "PEagleDraft",
    "QK_NORM_MODEL_TYPES",
    "has_qk_norm",
    "rope_inv_freq",
    "layout_inputs",
]


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding settings read from the target config (default, linear or llama3 scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RopeSpec:
        """Read `rope_parameters` (transformers >= 5) or legacy `rope_theta` + `rope_scaling`."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in ("default", "linear", "llama3"):
            raise BadInput(f"target RoPE type {rope_type!r} is not supported (default, linear, llama3)")
        if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise BadInput("target uses partial rotary embeddings, which the draft does not support")
        return cls(
            theta=theta,
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
            ),
        )

    def as_config(self) -> dict[str, Any]:
        """The `rope_parameters` dict for an exported HF config."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type == "linear":
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out.update(
                factor=self.factor,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """FloatTensor[head_dim // 2]: inverse frequencies (as transformers and vLLM compute them)."""
    inv = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if spec.rope_type == "linear":
        return inv / spec.factor
    if spec.rope_type == "llama3":
        old = spec.original_max_position_embeddings
        low_wl, high_wl = old / spec.low_freq_factor, old / spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / spec.factor, inv)
        smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


# Target model types whose attention normalises queries and keys per head (q_norm / k_norm): their draft layers are
# Qwen3 layers, the architecture vLLM's P-EAGLE loader accepts besides Llama.
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})


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
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise BadInput(f"target activation {act!r} is not supported by the Llama-style draft (silu)")
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
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            target_hidden_size=H,
            rope=RopeSpec.from_config(cfg),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            qk_norm=bool(qk_norm),
        )

    def layer_config(self) -> dict[str, Any]:
        """A Llama (or, with `qk_norm`, Qwen3) HF config dict of the draft (SPEC §6 `transformer_layer_config`)."""
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
            "rope_parameters": self.rope.as_config(),
            "rope_theta": self.rope.theta,
            "tie_word_embeddings": False,
            "initializer_range": self.initializer_range,
        }


# Elements per checkpointed piece of layer 0's context keys and values (`PEagleDraft._context_kv`): bounds the
# embeddings, fc output and norms (about 14 KB an element for SmolLM2 in fp32) that forward and the recomputation
# in backward materialise at once.
KV_CHUNK = 2048


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
    """Neox-style rotary embedding. x: [N, heads, D]; cos, sin: [N, 1, D]."""
    half = x.shape[-1] // 2
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
        """x: [Nq, in] query inputs; cos, sin: [Nq, 1, D]; mask [Nq, Nk]; kv: keys/values of all Nk elements
        (default: computed from x, Nk = Nq). Returns [Nq, H]."""
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


class PEagleDraft(nn.Module):
    """P-EAGLE draft: embeddings, fc over aux states, fused layer 0 (+ plain layers), final norm, lm_head.

    Args:
        cfg: sizes and settings.
        pieces: target tensors `embed_tokens.weight` [V, H], `lm_head.weight` [V, H], `norm.weight` [H]
            (embeddings, lm_head rows and final norm are initialised from them); None = random init.
        vocab: draft vocabulary (None = identity, Vd = V).
        generator: randomness for the initialisation of everything not taken from `pieces`.
        grad_checkpointing: recompute each layer in backward.
    """

    inv_freq: torch.Tensor  # [head_dim / 2] RoPE inverse frequencies (a non-persistent buffer)

    def __init__(
        self,
        cfg: DraftConfig,
        pieces: dict[str, torch.Tensor] | None = None,
        vocab: DraftVocab | None = None,
        generator: torch.Generator | None = None,
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if vocab is not None and (vocab.target_size != cfg.vocab_size or vocab.size != cfg.draft_vocab_size):
            raise BadInput(
                f"draft vocabulary ({vocab.size} of {vocab.target_size}) does not match the draft "
                f"config ({cfg.draft_vocab_size} of {cfg.vocab_size})"
            )
        if vocab is None and cfg.draft_vocab_size != cfg.vocab_size:
            raise BadInput("a draft vocabulary smaller than the target needs a DraftVocab")
        self.cfg, self.grad_checkpointing = cfg, grad_checkpointing
        H = cfg.hidden_size
        with torch.device("meta"):  # no global-RNG init: every tensor is filled below
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.fc = nn.Linear(cfg.aux_size, H, bias=False)
            self.layers = nn.ModuleList([DecoderLayer(cfg, fused=i == 0) for i in range(cfg.num_layers)])
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
            self.mask_hidden = nn.Parameter(torch.empty(1, 1, cfg.aux_size))
        self.to_empty(device="cpu")
        if vocab is not None and not vocab.is_identity:
            self.register_buffer("d2t", vocab.d2t.clone())
            self.register_buffer("t2d", vocab.t2d.clone())
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        self._init_weights(generator, pieces, vocab)
        self.lm_head.weight.requires_grad_(False)

    @torch.no_grad()
    def _init_weights(
        self, g: torch.Generator | None, pieces: dict[str, torch.Tensor] | None, vocab: DraftVocab | None
    ) -> None:
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "mask_hidden":
                p.normal_(0.0, 1.0, generator=g)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
        if pieces is None:
            return
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        expect = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,)}
        for key, shape in expect.items():
            if key not in pieces:
                raise BadInput(f"target pieces lack {key!r}")
            if tuple(pieces[key].shape) != shape:
                raise BadInput(f"target piece {key} has shape {tuple(pieces[key].shape)}, expected {shape}")
        self.embed_tokens.weight.copy_(pieces["embed_tokens.weight"].float())
        head = pieces["lm_head.weight"].float()
        self.lm_head.weight.copy_(head if vocab is None else head[vocab.ids])
        self.norm.weight.copy_(pieces["norm.weight"].float())

    def rope(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [N, 1, D] (fp32) for LongTensor[N] positions."""
        freqs = position.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        is_mask: torch.Tensor,
        position: torch.Tensor,
        attn_mask: AttnMask,
        aux_index: torch.Tensor | None = None,
        out_index: torch.Tensor | None = None,
        out_mask: AttnMask | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of the COD elements.

        Args:
            input_ids: LongTensor[N], real tokens (ignored where `is_mask`: `mask_token_id` is used).
            aux_hidden: [N, n_aux*H] aux states of each element (ignored where `is_mask`), any float dtype;
                or [R, n_aux*H] rows with `aux_index` LongTensor[N] picking each element's row (saves
                fc work and memory: fc runs on R rows).
            is_mask: BoolTensor[N], True at depth >= 1.
            position: LongTensor[N], RoPE positions.
            attn_mask: [N, N] bool or BlockMask (used by every layer; by all but the last when `out_index`).
            out_index: LongTensor[Nq], elements whose outputs are wanted; the last layer computes only their
                queries (keys/values still come from all N elements). Needs `out_mask` [Nq, N].

        Returns:
            [N, H] (or [Nq, H]) after the final norm.
        """
        ids = torch.where(is_mask, torch.full_like(input_ids, self.cfg.mask_token_id), input_ids)
        cos, sin = self.rope(position)
        last = len(self.layers) - 1
        if out_index is not None and last == 0:
            # Only the owned queries go through the layer; the keys/values of all N elements are checkpointed
            # from the raw inputs, so the many context rows keep just k and v alive (not embeddings, aux, norms).
            kv = self._context_kv(ids, aux_hidden, is_mask, aux_index, cos, sin)
            embeds, stream = self._layer0_inputs(ids, aux_hidden, is_mask, aux_index, out_index)
            stream = self._run_layer(0, stream, embeds, cos[out_index], sin[out_index], out_mask, kv)
            return self.norm(stream)
        embeds, stream = self._layer0_inputs(ids, aux_hidden, is_mask, aux_index, None)
        for i, layer in enumerate(self.layers):
            emb = embeds if i == 0 else None
            if i == last and out_index is not None:
                kv = self._checkpoint(layer.kv, stream, emb, cos, sin)
                stream = self._run_layer(
                    i, stream[out_index], None, cos[out_index], sin[out_index], out_mask, kv
                )
            else:
                stream = self._run_layer(i, stream, emb, cos, sin, attn_mask, None)
        return self.norm(stream)

    def _layer0_inputs(
        self,
        ids: torch.Tensor,
        aux: torch.Tensor,
        is_mask: torch.Tensor,
        aux_index: torch.Tensor | None,
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds [n, H], fc output [n, H]) of the elements `rows` (all if None)."""
        mask_row = self.mask_hidden.view(1, -1)  # [1, n_aux*H]
        if rows is not None:
            ids, is_mask = ids[rows], is_mask[rows]
            aux = aux[rows] if aux_index is None else aux[aux_index[rows]]  # fc on the wanted rows only
            aux_index = None
        if not torch.is_autocast_enabled(aux.device.type):  # under autocast the matmul casts by itself
            aux = aux.to(mask_row.dtype)  # after the gather: only the rows used (inside the checkpoints)
        if aux_index is None:
            stream = self.fc(torch.where(is_mask[:, None], mask_row.to(aux.dtype), aux))
        else:
            stream = torch.where(is_mask[:, None], self.fc(mask_row), self.fc(aux)[aux_index])  # fc on R rows
        return self.embed_tokens(ids), stream

    def _context_kv(
        self,
        ids: torch.Tensor,
        aux: torch.Tensor,
        is_mask: torch.Tensor,
        aux_index: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, Hkv, D] of layer 0 for all N elements, each `KV_CHUNK` rows checkpointed on their
        own: forward and the recomputation in backward hold one chunk's embeddings, fc output, norms and
        projections at a time, not those of the whole context (which is every depth-0 element left of a
        segment's end: the same size in a row's last segment as in a single pass)."""
        N = ids.shape[0]
        parts = [
            self._checkpoint(self._kv_rows, ids, aux, is_mask, aux_index, cos, sin, lo, min(N, lo + KV_CHUNK))
            for lo in range(0, N, KV_CHUNK)
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    def _kv_rows(
        self,
        ids: torch.Tensor,
        aux: torch.Tensor,
        is_mask: torch.Tensor,
        aux_index: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lo: int,
        hi: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's keys and values [hi - lo, Hkv, D] of elements lo..hi-1."""
        rows = torch.arange(lo, hi, device=ids.device)
        embeds, stream = self._layer0_inputs(ids, aux, is_mask, aux_index, rows)
        return self.layers[0].kv(stream, embeds, cos[lo:hi], sin[lo:hi])  # type: ignore[operator]

    def _checkpoint(self, fn: Any, *args: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _run_layer(
        self,
        i: int,
        stream: torch.Tensor,
        embeds: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttnMask,
        kv: Any,
    ) -> torch.Tensor:
        layer = self.layers[i]
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(layer, stream, embeds, cos, sin, mask, kv, use_reentrant=False)
        return layer(stream, embeds, cos, sin, mask, kv)

    def forward_layout(
        self,
        layout: CODLayout,
        tokens: torch.Tensor,
        aux_rows: torch.Tensor,
        attn_mask: AttnMask,
        out_index: torch.Tensor | None = None,
        out_mask: AttnMask | None = None,
    ) -> torch.Tensor:
        """Forward for a packed row: element inputs gathered from its rows (see `layout_inputs`)."""
        return self.forward(
            **layout_inputs(layout, tokens, aux_rows),
            attn_mask=attn_mask,
            out_index=out_index,
            out_mask=out_mask,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, Vd] draft logits (unchunked; the loss computes them in chunks itself)."""
        return self.lm_head(hidden)


def layout_inputs(layout: CODLayout, tokens: torch.Tensor, aux_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Keyword inputs of `PEagleDraft.forward` for a (sub-)layout of a packed row.

    fc runs only on the depth-0 rows of the layout: `aux_hidden` holds those rows and `aux_index` points
    each element at its row (depth >= 1 elements get `mask_hidden` instead).

    Args:
        layout: the elements; tokens: LongTensor[L] shifted tokens; aux_rows: [L, n_aux*H] aux states.
    """
    real = layout.depth == 0
    aux_index = torch.zeros_like(layout.target)
    aux_index[real] = torch.arange(int(real.sum()), device=aux_index.device)
    return {
        "input_ids": tokens[layout.target],
        "aux_hidden": aux_rows[layout.target[real]],
        "is_mask": ~real,
        "position": layout.position,
        "aux_index": aux_index,
    }
