"""Rotary position embeddings of the draft: the target's RoPE settings and their inverse frequencies.

Pure torch: no I/O, no global state. Default, linear, llama3, YaRN and LongRoPE scaling, computed as transformers and
vLLM compute them, over all of each head or (partial rotary, as Qwen3-Next and Qwen3.5 set it) over its first
`partial_rotary_factor * head_dim` dimensions; any other RoPE type is refused.

Worked example: theta = 10000, head_dim = 4 gives inv_freq = [1, 10000**-0.5] = [1.0, 0.01]; linear scaling with
factor 2 halves them to [0.5, 0.005]. Position p rotates the pair (x_i, x_{i + D/2}) by angle p * inv_freq[i].
Partial rotary: with partial_rotary_factor 0.25 and head_dim 16, only the first 4 dimensions turn, with the same
inv_freq [1.0, 0.01] (computed over those 4): pairs (x_0, x_2) and (x_1, x_3); x_4 .. x_15 pass through.

YaRN (gpt-oss, Qwen3 with its long-context setting, DeepSeek) blends the two per frequency: pairs that turn more than
beta_fast times over the original context keep their frequency, pairs that turn less than beta_slow times are
divided by the factor, a linear ramp in between; and cos and sin are multiplied by an attention factor (0.1 ln(factor)
+ 1 unless the config sets it), which scales every attention logit by its square. E.g. factor 4 gives 1.1386.

LongRoPE (Phi-3.5, Phi-4-mini) divides each pair's frequency by its own factor, from one list up to the original
context ("short") and another past it ("long"), and multiplies cos and sin by sqrt(1 + ln(factor) / ln(original)) (factor =
max / original positions): 1.1902 for 128k over 4k. Which list the target uses depends on the runtime (transformers:
the sequence's length; vLLM: the whole server's `max_model_len`), so the draft takes one list for every position, the
short one (the one the target rotates by at the lengths drafts train on), and exports it as both lists: vLLM then
turns the draft's queries and keys as training did whatever the server's context. E.g. theta 10000, head_dim 4 and
short factors [1, 2]: inv_freq = [1.0, 0.005].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from peagle_pipeline.errors import BadInput

__all__ = ["RopeSpec", "rope_inv_freq"]


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding settings read from the target config (default, linear, llama3, yarn or longrope scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    """yarn: pairs turning more often than this over the original context keep their frequency."""
    beta_slow: float = 1.0
    """yarn: pairs turning less often than this are divided by the factor."""
    truncate: bool = True
    """yarn: round the ramp's ends to whole pairs (gpt-oss sets false)."""
    attention_factor: float = 1.0
    """cos and sin are multiplied by it (yarn's attention scaling; 1 for the other types)."""
    partial_rotary_factor: float = 1.0
    """The share of each head's dimensions that turn (the first ones); the rest pass through."""
    pair_factors: tuple[float, ...] = ()
    """longrope: each pair's frequency is divided by its factor (the target's short factors; rotary_dim / 2 of them)."""

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's `head_dim` dimensions turn (as transformers and vLLM round it)."""
        return int(head_dim * self.partial_rotary_factor)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RopeSpec:
        """Read `rope_parameters` (transformers >= 5) or legacy `rope_theta` + `rope_scaling`, resolving what
        transformers derives: yarn's and longrope's factor (max / original positions when unset) and attention factor.

        A target with one RoPE per layer type (Gemma 4: `{"full_attention": {...}, "sliding_attention": {...}}`)
        gives the draft the default rotation, over the whole head, at its full-attention layers' base: the draft
        attends over the whole context as those layers do, and starts from random weights there (its layers are
        not Llama ones), so it copies no layer's rotation."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        if isinstance(
            params.get("full_attention"), dict
        ):  # one RoPE per layer type (Gemma 4): see the docstring
            full = params["full_attention"]
            params = {
                "rope_type": "default",
                "rope_theta": full.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            }
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise BadInput(
                f"target RoPE type {rope_type!r} is not supported (default, linear, llama3, yarn, longrope)"
            )
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        if not 0.0 < partial <= 1.0:
            raise BadInput(f"target partial_rotary_factor {partial} is outside (0, 1]")
        # a top-level original_max_position_embeddings (Phi-3 style) wins, as in transformers
        original = int(
            cfg.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 8192)
        )
        factor = float(params.get("factor") or 1.0)
        spec = cls(
            theta=theta,
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            partial_rotary_factor=partial,
        )
        if rope_type == "longrope":
            return _longrope(spec, params, cfg)
        if rope_type == "yarn":
            return _yarn(spec, params, cfg)
        return spec

    def as_config(self, max_position_embeddings: int | None = None) -> dict[str, Any]:
        """The `rope_parameters` dict for an exported HF config whose `max_position_embeddings` is the one given
        (vLLM derives LongRoPE's attention factor from it, so a factor that differs is written out for vLLM)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_type == "linear":
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out.update(
                factor=self.factor,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        if self.rope_type == "yarn":  # every derived value written out, so that vLLM and transformers agree
            out.update(
                factor=self.factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=self.truncate,
                attention_factor=self.attention_factor,
            )
        if self.rope_type == "longrope":  # one list for every position: see the module docstring
            out.update(
                short_factor=list(self.pair_factors),
                long_factor=list(self.pair_factors),
                original_max_position_embeddings=self.original_max_position_embeddings,
                factor=self.factor,
                attention_factor=self.attention_factor,
            )
            served = _longrope_mscale(
                (max_position_embeddings or 0) / self.original_max_position_embeddings,
                self.original_max_position_embeddings,
            )
            if not math.isclose(served, self.attention_factor, rel_tol=1e-12):
                out.update(short_mscale=self.attention_factor, long_mscale=self.attention_factor)
        return out


def _yarn(spec: RopeSpec, params: dict[str, Any], cfg: dict[str, Any]) -> RopeSpec:
    """YaRN's settings (spec has the common ones): transformers' factor (max / original positions unless set) and
    attention factor (the config's, else from mscale and mscale_all_dim when both are set, else from the factor)."""
    original = spec.original_max_position_embeddings
    factor = _context_factor(params, cfg, original)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    return replace(
        spec,
        factor=factor,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention),
    )


def _longrope(spec: RopeSpec, params: dict[str, Any], cfg: dict[str, Any]) -> RopeSpec:
    """LongRoPE's settings (spec has the common ones): the short factors for every position, transformers'
    factor (max / original positions unless set) and attention factor (vLLM's `short_mscale` when the target sets
    it, else the config's `attention_factor`, else derived from the factor).

    Raises:
        BadInput: the factor lists are missing or not rotary_dim / 2 numbers long.
    """
    short, long = params.get("short_factor"), params.get("long_factor")
    if not (isinstance(short, list | tuple) and isinstance(long, list | tuple)):
        raise BadInput("target longrope RoPE needs its short_factor and long_factor lists")
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // cfg.get("num_attention_heads", 1)
    pairs = spec.rotary_dim(int(head_dim)) // 2
    if pairs and not len(short) == len(long) == pairs:
        raise BadInput(
            f"target longrope RoPE has {len(short)} short and {len(long)} long factors, not one per turning pair ({pairs})"
        )
    original = spec.original_max_position_embeddings
    factor = _context_factor(params, cfg, original)
    attention = params.get("short_mscale") or params.get("attention_factor")
    return replace(
        spec,
        factor=factor,
        pair_factors=tuple(float(f) for f in short),
        attention_factor=float(attention) if attention else _longrope_mscale(factor, original),
    )


def _context_factor(params: dict[str, Any], cfg: dict[str, Any], original: int) -> float:
    """yarn's and longrope's `factor`: the config's, else max / original positions (as transformers derives it)."""
    return float(params.get("factor") or int(cfg.get("max_position_embeddings", original)) / original)


def _longrope_mscale(factor: float, original: int) -> float:
    """LongRoPE's magnitude correction for a context `factor` times the `original`: sqrt(1 + ln factor / ln original)."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """FloatTensor[rotary_dim // 2]: inverse frequencies over the turning dimensions (`RopeSpec.rotary_dim`, all of
    `head_dim` unless the rotary is partial), as transformers and vLLM compute them."""
    head_dim = spec.rotary_dim(head_dim)
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
    if spec.rope_type == "yarn":
        return _yarn_inv_freq(spec, head_dim)
    if spec.rope_type == "longrope":  # as transformers: 1 / (factor * theta ** (2i / dim))
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(spec.pair_factors, dtype=torch.float32) * spec.theta**shape)
    return inv


def _yarn_inv_freq(spec: RopeSpec, dim: int) -> torch.Tensor:
    """YaRN's blend of the original (extrapolated) and the factor-divided (interpolated) frequencies."""
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (spec.factor * pos_freqs)

    def pair_turning(
        turns: float,
    ) -> float:  # the pair index that turns `turns` times over the original context
        context = spec.original_max_position_embeddings
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = pair_turning(spec.beta_fast), pair_turning(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its original frequency
    return interpolated * (1 - keep) + extrapolated * keep
