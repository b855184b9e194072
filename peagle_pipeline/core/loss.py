"""Chunked forward KL(target || draft) over the draft vocabulary, top-1 agreement and acceptance estimates.

Pure torch: no I/O. Returns sums and counts, never means: the caller divides by the global count (all ranks,
micro-steps and segments; docs/reference/algorithm.md). The KL runs `chunk` elements at a time inside one autograd Function
that computes the gradient wrt the hidden states while the chunk's logits are alive (d KL / d logits = q - p),
so no [N, Vd] tensor ever exists and backward does no recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from peagle_pipeline.core.cod import CODLayout
from peagle_pipeline.core.vocab import DraftVocab

__all__ = [
    "Counted",
    "LossOutput",
    "kl_topk",
    "kl_exact",
    "topk_targets",
    "leading_correct",
    "acceptance_estimate",
    "acceptance_walk",
]


@dataclass(frozen=True, slots=True)
class LossOutput:
    """Sums and counts of one forward over N elements."""

    loss_sum: torch.Tensor
    """Scalar: summed KL over counted elements (differentiable wrt hidden states)."""
    count: torch.Tensor
    """Int scalar: elements with weight 1 and a usable target (the divisor's share)."""
    excluded: torch.Tensor
    """Int scalar: weighted elements dropped because no stored top-k id is in the draft vocabulary."""
    correct: torch.Tensor
    """LongTensor[K]: counted elements per depth whose draft argmax equals the target argmax."""
    total: torch.Tensor
    """LongTensor[K]: counted elements per depth."""
    element_correct: torch.Tensor
    """BoolTensor[N]: argmax agreement per element (meaningful where `element_valid`)."""
    element_valid: torch.Tensor
    """BoolTensor[N]: the counted elements."""


def topk_targets(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab: DraftVocab | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map stored top-k targets into the draft vocabulary and renormalise the kept probabilities.

    Args:
        topk_ids: LongTensor[N, k] target-vocabulary ids; topk_logprobs: [N, k] log-probabilities.
        vocab: draft vocabulary (None = identity).

    Returns:
        draft_ids LongTensor[N, k] (0 where dropped), probs FloatTensor[N, k] (0 where dropped, rows sum to 1),
        has_target BoolTensor[N] (some id kept), top1 LongTensor[N] (target-vocabulary argmax of the stored ids).
    """
    ids = topk_ids.long()
    d = ids if vocab is None else vocab.target_to_draft.to(ids.device)[ids]  # [N, k], -1 outside
    keep = d >= 0
    p = topk_logprobs.float().exp() * keep
    z = p.sum(-1, keepdim=True)  # [N, 1]
    has = z[:, 0] > 0
    p = p / z.clamp_min(torch.finfo(torch.float32).tiny)
    top1 = ids.gather(1, topk_logprobs.float().argmax(-1, keepdim=True))[:, 0]
    return d.clamp_min(0), p, has, top1


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


# Elements per block of `_log_softmax` (8 MiB in fp32). A chunk's [chunk, Vd] logits are the largest buffers of a
# training step and do not shrink with sequence partitioning (one chunk of 2048 elements over 32,000 draft tokens is
# 250 MiB in fp32): log-softmax block by block writes over them instead of allocating a second [chunk, Vd] buffer.
SOFTMAX_BLOCK = 1 << 21


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim of logits [c, Vd], in blocks of rows: in place for fp32 logits, else into
    one fp32 buffer (the values are those of `torch.log_softmax(logits.float(), -1)`: each row on its own)."""
    out = logits if logits.dtype == torch.float32 else torch.empty_like(logits, dtype=torch.float32)
    rows = max(1, SOFTMAX_BLOCK // max(1, logits.shape[-1]))
    for lo in range(0, logits.shape[0], rows):
        out[lo : lo + rows] = torch.log_softmax(logits[lo : lo + rows].float(), dim=-1)
    return out


class _HowKL(NamedTuple):
    """How `_ChunkedKL` runs: the target `kind` ("topk" or "exact"), elements per chunk, the matmul dtype, and
    whether to form the gradient."""

    kind: str
    chunk: int
    dtype: torch.dtype
    want_grad: bool


class _ChunkedKL(torch.autograd.Function):
    """loss = sum_i w_i KL(p_i || softmax(h_i W^T)); the gradient is formed chunk by chunk in forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        w: torch.Tensor,
        tgt: tuple[Any, ...],
        how: _HowKL,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kind, chunk, dtype, want_grad = how
        N, dev = hidden.shape[0], hidden.device
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        draft_top = torch.zeros(N, dtype=torch.long, device=dev)
        target_top = torch.zeros(N, dtype=torch.long, device=dev)
        grad_h = torch.empty_like(hidden, dtype=torch.float32) if want_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_grad and weight.requires_grad else None
        W = weight.detach().to(dtype)
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            for lo in range(0, N, chunk):
                hi = min(N, lo + chunk)
                h = hidden[lo:hi].detach().to(dtype)
                logq = _log_softmax(h @ W.T)  # [c, Vd] fp32
                draft_top[lo:hi] = logq.argmax(-1)
                wc = w[lo:hi]  # [c] element weights (0 where not counted)
                if kind == "topk":
                    ids, p = tgt[0][lo:hi], tgt[1][lo:hi]  # [c, k]
                    kl = (torch.xlogy(p, p) - p * logq.gather(1, ids)).sum(-1)
                else:
                    t = tgt[0][lo:hi].float()
                    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + tgt[2]) * tgt[1].float()
                    logp = _log_softmax(t.to(dtype) @ W.T)  # [c, Vd] fp32
                    target_top[lo:hi] = logp.argmax(-1)
                    kl = (logp.exp() * (logp - logq)).sum(-1)
                loss += (kl * wc).sum()
                if grad_h is None:
                    continue
                g = logq.exp_()  # q, in place of log q
                if kind == "topk":
                    g.scatter_add_(1, ids, -p)
                else:
                    g.sub_(logp.exp_())
                g.mul_(wc[:, None])  # [c, Vd] = w (q - p)
                gd = g.to(dtype)
                grad_h[lo:hi] = gd @ W
                if grad_w is not None:
                    grad_w += (gd.T @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(draft_top, target_top)
        return loss, draft_top, target_top

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else (grad_loss * grad_h).to(ctx.hidden_dtype)
        gw = None if grad_w is None else (grad_loss * grad_w).to(ctx.weight_dtype)
        return gh, gw, None, None, None


def _run(
    hidden: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, kind: str, tgt: tuple[Any, ...], chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    want = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedKL.apply(
        hidden, weight, w, tgt, _HowKL(kind, max(1, int(chunk)), _compute_dtype(hidden), want)
    )


def _summarise(
    loss: torch.Tensor,
    correct: torch.Tensor,
    valid: torch.Tensor,
    excluded: torch.Tensor,
    depth: torch.Tensor,
    num_depths: int,
) -> LossOutput:
    d = depth.clamp(0, num_depths - 1)
    # counts per depth by index_add: the bincount of a boolean-masked selection waits for the device (its size)
    zeros = torch.zeros(num_depths, dtype=torch.long, device=d.device)
    total = zeros.index_add(0, d, valid.long())
    right = zeros.index_add(0, d, (valid & correct).long())
    return LossOutput(
        loss_sum=loss,
        count=valid.sum(),
        excluded=excluded.sum(),
        correct=right,
        total=total,
        element_correct=correct,
        element_valid=valid,
    )


class Counted(NamedTuple):
    """Which elements a loss counts, and at which depth: `weight` BoolTensor[N] (the element's loss weight) or
    FloatTensor[N] of factors on each element's KL (EAGLE-3's per-step weights; an element with a non-zero weight
    is counted in the agreement and `count`), `depth` LongTensor[N], and `num_depths` K (the size of the per-depth
    counters)."""

    weight: torch.Tensor
    depth: torch.Tensor
    num_depths: int


def kl_topk(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    counted: Counted,
    vocab: DraftVocab | None,
    chunk: int = 2048,
) -> LossOutput:
    """KL against renormalised stored top-k targets.

    Args:
        hidden: [N, H] final-normed draft hidden states.
        lm_head_weight: [Vd, H] (frozen or not; its gradient is formed only if it requires grad).
        topk_ids: LongTensor[N, k] target-vocabulary ids of each element's target row; topk_logprobs [N, k].
        counted: the elements' weights and depths, and K.
        vocab: draft vocabulary (None = identity).
        chunk: elements per chunk.
    """
    weight, depth, num_depths = counted
    ids, p, has, top1 = topk_targets(topk_ids, topk_logprobs, vocab)
    valid = weight.to(torch.bool) & has
    loss, argmax, _ = _run(hidden, lm_head_weight, weight.float() * valid, "topk", (ids, p), chunk)
    draft_top = argmax if vocab is None else vocab.ids.to(argmax.device)[argmax]
    return _summarise(loss, draft_top == top1, valid, weight.to(torch.bool) & ~has, depth, num_depths)


def kl_exact(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    target_hidden: torch.Tensor,
    target_norm: tuple[torch.Tensor, float],
    counted: Counted,
    chunk: int = 2048,
) -> LossOutput:
    """KL against exact targets: softmax over the draft vocabulary of lm_head_rows(final_norm(h_L)).

    Args:
        hidden: [N, H] final-normed draft hidden states.
        lm_head_weight: [Vd, H], the target lm_head rows of the draft vocabulary.
        target_hidden: [N, H] pre-norm last target hidden state (layer id L) of each element's target row.
        target_norm: the target's final norm: its weight [H] and its epsilon.
        counted, chunk: as in `kl_topk`.
    """
    weight, depth, num_depths = counted
    target_norm_weight, target_norm_eps = target_norm
    valid = weight.to(torch.bool)
    tgt = (target_hidden, target_norm_weight, float(target_norm_eps))
    loss, argmax, target_top = _run(hidden, lm_head_weight, weight.float(), "exact", tgt, chunk)
    return _summarise(loss, argmax == target_top, valid, torch.zeros_like(valid), depth, num_depths)


def leading_correct(
    layout: CODLayout, element_correct: torch.Tensor, element_weight: torch.Tensor, num_depths: int
) -> torch.Tensor:
    """LongTensor[L]: per packed row (anchor), the number of leading depths 0, 1, ... whose elements exist, are
    weighted and are correct (use a `full=True` layout; a chain cut short by the end of a supervised span stops
    there)."""
    table = torch.zeros(layout.rows, num_depths, dtype=torch.long, device=element_correct.device)
    ok = (element_correct & element_weight).long()
    keep = layout.depth < num_depths
    table[layout.anchor[keep], layout.depth[keep]] = ok[keep]
    return table.cumprod(dim=1).sum(dim=1)


def acceptance_estimate(
    layout: CODLayout, element_correct: torch.Tensor, element_weight: torch.Tensor, num_depths: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of the estimated acceptance length over anchors (use a `full=True` layout).

    For each anchor a whose depth-0 element is weighted: 1 + `leading_correct` at a.

    Returns:
        (sum FloatTensor scalar, count LongTensor scalar).
    """
    L = layout.rows
    run = leading_correct(layout, element_correct, element_weight, num_depths)
    anchors = element_weight[:L] & (layout.depth[:L] == 0)
    return (1 + run[anchors]).sum().float(), anchors.sum()


def acceptance_walk(
    layout: CODLayout, element_correct: torch.Tensor, element_weight: torch.Tensor, num_depths: int
) -> tuple[int, int]:
    """Accepted tokens and speculative steps of greedy decoding as vLLM walks it (use a `full=True` layout).

    Each run of weighted rows of one sample is a reply [s, e): vLLM's first proposal pairs the row before the
    reply's first token with that token (row s), a proposal at row a has its leading correct depths accepted
    (n, only tokens inside the reply), and the next one is made at row a + n + 1. The proposal made after the
    reply's last token (row e - 1) is never verified. So where the rows are the target's own greedy replies
    and correct means "equals the target's top-1", 1 + accepted / steps is the acceptance length vLLM measures
    at T = 0 (`tests/vllm/proposals.py` checks that vLLM drafts what the model computes).

    Worked example: weight [0, 1, 1, 1, 1, 1, 0] (a reply in rows 1..5, s = 1, e = 6), leading correct depths per
    row [., 2, 0, 3, 2, 0, .]: the proposal at row 1 accepts 2; the next, at row 4, accepts min(2, e - 1 - 4) = 1
    (its depth 1 would predict the token after the reply); row 5's is never verified: 3 accepted in 2 steps, AL
    2.5. (The anchor mean of `acceptance_estimate` over rows 1..5 reads 1 + 7 / 5 = 2.4.)

    Returns:
        (accepted, steps).
    """
    L = layout.rows
    run = leading_correct(layout, element_correct, element_weight, num_depths).tolist()
    weighted = (element_weight[:L] & (layout.depth[:L] == 0)).tolist()
    doc = layout.doc[:L].tolist()
    accepted = steps = 0
    s = 0
    while s < L:
        if not weighted[s]:
            s += 1
            continue
        e = s
        while e < L and weighted[e] and doc[e] == doc[s]:
            e += 1
        a = s
        while a <= e - 2:
            n = min(run[a], e - 1 - a)
            accepted, steps, a = accepted + n, steps + 1, a + n + 1
        s = e
    return accepted, steps
