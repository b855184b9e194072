"""Helpers of the vLLM tier: render real chat samples, and compare two backends' outputs sample by sample."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compare", "render_samples", "topk_overlap"]


def render_samples(model: str, data: str, n: int, max_length: int) -> list[list[int]]:
    """The first `n` conversations of `data` that render, as token ids truncated to `max_length`."""
    from transformers import AutoTokenizer

    from peagle_pipeline.data.chat import ChatRenderer, RejectRow
    from peagle_pipeline.data.formats import iter_rows
    from peagle_pipeline.data.records import Conversation

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model))
    out: list[list[int]] = []
    for row in iter_rows([data]):
        if not isinstance(row, Conversation):
            continue
        try:
            out.append(renderer.render(row.messages).input_ids[:max_length])
        except RejectRow:
            continue
        if len(out) == n:
            break
    return out


def topk_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |set(a_row) & set(b_row)| / k for two [T, k] id tensors."""
    k = a.shape[1]
    hits = (a[:, :, None] == b[:, None, :]).any(-1).sum()  # [T, k, k] -> matches of a's ids in b's row
    return hits.item() / (a.shape[0] * k)


def compare(ref: list[Any], got: list[Any]) -> dict[str, float]:
    """Agreement of two lists of SampleOutputs (same samples, same order).

    Returns:
        aux_max_abs: max |a - b| over all aux states; aux_rel: ||a - b|| / ||a|| (Frobenius, all samples);
        aux_max_abs_scale: max |a| (for scale); last_rel: the same relative error for the last hidden state
        (nan if absent); topk_overlap: mean set overlap of the top-k ids; top1_agree: fraction of rows with the
        same argmax; top1_logprob_max_abs: max |difference| of the top-1 log-probs where the argmax agrees.
    """
    diff2 = ref2 = last_d2 = last_r2 = 0.0
    max_abs = scale = lp_max = 0.0
    hits = top1 = rows = 0
    for a, b in zip(ref, got, strict=True):
        if a.aux_hidden.shape != b.aux_hidden.shape or a.topk_ids.shape != b.topk_ids.shape:
            raise AssertionError(f"shape mismatch {a.aux_hidden.shape} vs {b.aux_hidden.shape}")
        x, y = a.aux_hidden.float(), b.aux_hidden.float()
        diff2 += (x - y).pow(2).sum().item()
        ref2 += x.pow(2).sum().item()
        max_abs = max(max_abs, (x - y).abs().max().item())
        scale = max(scale, x.abs().max().item())
        if a.last_hidden is not None and b.last_hidden is not None:
            last_d2 += (a.last_hidden.float() - b.last_hidden.float()).pow(2).sum().item()
            last_r2 += a.last_hidden.float().pow(2).sum().item()
        T, k = a.topk_ids.shape
        hits += round(topk_overlap(a.topk_ids, b.topk_ids) * T * k)
        same = a.topk_ids[:, 0] == b.topk_ids[:, 0]
        top1 += int(same.sum())
        if same.any():
            lp_max = max(lp_max, (a.topk_logprobs[same, 0] - b.topk_logprobs[same, 0]).abs().max().item())
        rows += T
    k = ref[0].topk_ids.shape[1]
    return {
        "aux_max_abs": max_abs,
        "aux_max_abs_scale": scale,
        "aux_rel": (diff2 / ref2) ** 0.5,
        "last_rel": (last_d2 / last_r2) ** 0.5 if last_r2 else float("nan"),
        "topk_overlap": hits / (rows * k),
        "top1_agree": top1 / rows,
        "top1_logprob_max_abs": lp_max,
        "rows": rows,
    }
