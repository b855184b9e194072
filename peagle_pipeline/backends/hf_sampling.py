"""Next-token choice for the HF decode loop, one row per request, each drawing from its own random stream.

A request's randomness is fixed before it starts: `request_uniforms(seed, n)` draws its n uniforms from a
`torch.Generator` seeded with the request's own seed, and its k-th token is sampled by inverse CDF with the k-th
uniform. So a reply depends only on its prompt, its seed and the settings, never on which requests share its batch
or in which order they run. The semantics are transformers' (repetition penalty, then temperature, then top-p with
top-k off); temperature 0 is greedy (argmax: the first of equal maxima, as transformers picks).
"""

from __future__ import annotations

import torch

from peagle_pipeline.backends.generation import SamplingSettings

__all__ = ["request_uniforms", "penalize", "next_tokens"]


def request_uniforms(seed: int, n: int) -> torch.Tensor:
    """The n uniforms in [0, 1) of one request, [n] float32, from its own generator (the caller's RNG untouched)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: seen tokens' logits divided by `penalty` (multiplied when negative).

    Args:
        logits: [n, V] float32.
        seen: [n, V] bool, the tokens of each row's prompt and reply so far.
    """
    hit = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, hit, logits)


def next_tokens(
    logits: torch.Tensor, u: torch.Tensor, s: SamplingSettings, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """The next token of each row, [n] int64.

    Args:
        logits: [n, V] float32 logits of the last position.
        u: [n] float32, each row's uniform for this token (unused when greedy).
        seen: [n, V] bool for the repetition penalty (None: no penalty).
    """
    if seen is not None and s.repetition_penalty != 1.0:
        logits = penalize(logits, seen, s.repetition_penalty)
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / s.temperature
    if s.top_p >= 1.0:
        probs, order = logits.softmax(dim=-1), None
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # the nucleus: tokens whose probability mass before them is below top_p (the first always stays)
        probs = probs * ((probs.cumsum(dim=-1) - probs) < s.top_p)
    cdf = probs.cumsum(dim=-1)  # [n, V]
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)  # [n, 1], below the row's total mass
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [n, 1]
    return (pick if order is None else order.gather(1, pick)).squeeze(1)
