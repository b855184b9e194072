"""Optimizer and learning-rate schedule of a training run (AdamW; warm-up then cosine, linear or constant)."""

from __future__ import annotations

import math

import torch

__all__ = ["build_optimizer", "lr_at"]


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the lm_head is frozen), betas (0.9, 0.95), peak `lr` and `weight_decay`
    (the run's `lr` and `weight_decay` settings)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


def lr_at(step: int, peak: float, warmup: int, total: int, schedule: str) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up to `peak`, then cosine/linear to 0 or flat.

    Example: peak 1.0, warmup 2, total 6, cosine -> 0.5, 1.0, 1.0, 0.854, 0.5, 0.146.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return peak * max(0.0, 1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
