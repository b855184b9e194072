"""Rotary position embeddings of the draft (SPEC §5.3): the target's RoPE settings and their inverse frequencies.

Pure torch: no I/O, no global state. Default, linear and llama3 scaling, computed as transformers and vLLM compute
them; any other RoPE type (or partial rotary embeddings) is refused.

Worked example: theta = 10000, head_dim = 4 gives inv_freq = [1, 10000**-0.5] = [1.0, 0.01]; linear scaling with
factor 2 halves them to [0.5, 0.005]. Position p rotates the pair (x_i, x_{i + D/2}) by angle p * inv_freq[i].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from peagle_pipeline.errors import BadInput

__all__ = ["RopeSpec", "rope_inv_freq"]


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
