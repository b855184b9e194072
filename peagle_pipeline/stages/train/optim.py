"""Optimizer and learning-rate schedule of a training run (AdamW, row-sparse for embedding tables; warm-up then
cosine, linear or constant)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from peagle_pipeline.stages.train.fsdp import local

__all__ = ["build_optimizer", "clip_grad_norm", "effective_warmup", "lr_at", "RowSparseAdamW"]


class RowSparseAdamW(torch.optim.AdamW):
    """AdamW that updates the `row_sparse` tables (embeddings) only in the rows that have a gradient this step.

    A step's packed rows hold a few hundred distinct tokens, yet plain AdamW reads and writes every row of an
    embedding table and of both its moment buffers on every step: for SmolLM2 (49,152 x 576) that was about 40 %
    of a CPU training step (1.76x the tokens/s with the table frozen). Here a row without gradient keeps its
    weights and moments as they are (lazy Adam: no momentum-only drift, no weight decay while unused); a row with
    a gradient gets exactly AdamW's update, with the table's step count for the bias correction. Every other
    parameter is plain AdamW. The state dict has AdamW's layout, so checkpoints load either way.

    A table's gradient may be dense or sparse (an `nn.Embedding(sparse=True)`, which spares the zero-filled
    [R, H] gradient each step); both give the same update. A table sharded by rows (FSDP, `stages.train.fsdp`) is
    updated shard by shard: each rank updates the rows it holds, which is the same update.
    """

    def __init__(
        self, params: Iterable[torch.Tensor], row_sparse: Iterable[torch.Tensor], **kwargs: Any
    ) -> None:
        super().__init__(params, **kwargs)
        if any(group["amsgrad"] for group in self.param_groups):
            raise ValueError("RowSparseAdamW does not support amsgrad")
        self._row_sparse = {id(p) for p in row_sparse}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:  # gradients first, so the row-sparse ones below are this step's
            with torch.enable_grad():
                loss = closure()
        held: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:  # AdamW skips a parameter without grad: hand it the dense ones only
            for p in group["params"]:
                if id(p) in self._row_sparse and p.grad is not None:
                    held.append((group, p, p.grad))
                    p.grad = None
        super().step()
        for group, p, grad in held:
            p.grad = grad
            self._row_step(group, p, grad)
        return loss

    def _row_step(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        """AdamW's update of the rows of 2-D `p` [R, H] whose gradient is not all zero."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        p, grad = local(p), local(grad)  # a row-sharded table: this rank's rows (views of the shards)
        exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
        if grad.is_sparse:
            grad = grad.coalesce()
            rows, g = grad.indices()[0], grad.values()  # LongTensor[n], [n, H]
            # as for a dense gradient: a row whose gradient is all zero stays as it is
            keep = g.ne(0).any(dim=1)
            rows, g = rows[keep], g[keep]
        else:
            rows = grad.any(dim=1).nonzero().squeeze(1)  # LongTensor[n]
            g = grad[rows]
        if rows.numel() == 0:
            return
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        t = float(state["step"])
        m = exp_avg[rows].lerp_(g, 1 - beta1)
        v = exp_avg_sq[rows].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        w = p[rows].mul_(1 - lr * decay)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        exp_avg[rows], exp_avg_sq[rows], p[rows] = m, v, w


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the lm_head is frozen), betas (0.9, 0.95), peak `lr` and `weight_decay`
    (the run's `lr` and `weight_decay` settings); embedding tables are updated row-sparse (`RowSparseAdamW`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    tables = [
        m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad
    ]
    return RowSparseAdamW(params, tables, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    all_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scale the gradients of `params` so that their global L2 norm is at most `max_norm`; returns the norm before.

    `torch.nn.utils.clip_grad_norm_` for gradients that may be sparse (a sparse gradient is coalesced in place
    first, so repeated rows count once). A non-finite norm leaves the gradients as they are. Sharded gradients
    (FSDP: every parameter in `params` sharded) give their local shards, and `all_sum` (a sum over ranks of a CPU
    tensor, in place) adds up the squares of all ranks.
    """
    grads: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
            grads.append(p.grad.values())
        else:
            grads.append(local(p.grad))
    if all_sum is not None:
        squares = sum((torch.linalg.vector_norm(g.float()) ** 2 for g in grads), torch.tensor(0.0))
        norm = all_sum(squares.detach().double().cpu().reshape(1))[0].sqrt().float()
    elif not grads:
        return torch.tensor(0.0)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if math.isfinite(float(norm)) and float(norm) > max_norm:
        coef = max_norm / (float(norm) + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm


def effective_warmup(warmup: int, total: int) -> int:
    """The warm-up steps a run of `total` steps uses: `warmup`, or a tenth of the run (rounded up) when `warmup`
    is not below `total`, so the lr still reaches its peak (e.g. `--steps 20` with the default 50 -> 2)."""
    if warmup <= 0 or warmup < total:
        return max(0, warmup)
    return max(1, -(-total // 10))


def lr_at(step: int, peak: float, warmup: int, total: int, schedule: str) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up to `peak`, then cosine/linear to 0 or flat.

    The warm-up is `effective_warmup(warmup, total)`.
    Example: peak 1.0, warmup 2, total 6, cosine -> 0.5, 1.0, 1.0, 0.854, 0.5, 0.146.
    """
    warmup = effective_warmup(warmup, total)
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return peak * max(0.0, 1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
