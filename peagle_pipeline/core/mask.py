"""The P-EAGLE attention mask (docs/reference/algorithm.md): one predicate, rendered as a flex BlockMask (CUDA) or a dense
boolean matrix (CPU SDPA), and `attend`, which runs attention with either.

Pure torch: no I/O, no global state. Query q = (a_q, d_q) may see key k = (a_k, d_k) iff both are in the
same non-padding sample and (d_k == 0 and a_k <= a_q) or (a_k == a_q and d_k <= d_q).

Worked example (anchors/depths of the cod.py example, one sample, one padding row 6): element 7 = (1, 1)
sees depth-0 rows 0, 1 and itself; element 9 = (3, 2) sees rows 0..3, element 8 = (3, 1) and itself;
padding row 6 sees nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from peagle_pipeline.core.cod import CODLayout

__all__ = ["allowed", "mask_mod", "dense_mask", "build_block_mask", "build_mask", "attend", "AttnMask"]

log = logging.getLogger(__name__)

AttnMask = Any  # torch.Tensor (dense bool [Nq, Nk]) or flex_attention.BlockMask


def allowed(
    q_anchor: torch.Tensor,
    q_depth: torch.Tensor,
    q_doc: torch.Tensor,
    k_anchor: torch.Tensor,
    k_depth: torch.Tensor,
    k_doc: torch.Tensor,
) -> torch.Tensor:
    """The mask predicate, elementwise with broadcasting: True where query may attend key."""
    same_doc = (q_doc == k_doc) & (q_doc >= 0)
    context = (k_depth == 0) & (k_anchor <= q_anchor)
    own_chain = (k_anchor == q_anchor) & (k_depth <= q_depth)
    return same_doc & (context | own_chain)


def mask_mod(layout: CODLayout, query: torch.Tensor | None = None) -> Callable[..., torch.Tensor]:
    """A flex-attention `mask_mod(b, h, q_idx, kv_idx)` for `layout` (queries = `query` elements if given)."""
    anchor, depth, doc = layout.anchor, layout.depth, layout.doc
    qa, qd, qdoc = (anchor, depth, doc) if query is None else (anchor[query], depth[query], doc[query])

    def mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return allowed(qa[q_idx], qd[q_idx], qdoc[q_idx], anchor[kv_idx], depth[kv_idx], doc[kv_idx])

    return mod


def dense_mask(layout: CODLayout, query: torch.Tensor | None = None) -> torch.Tensor:
    """BoolTensor[Nq, N]: the predicate for every (query, key) pair (vectorised).

    Args:
        layout: the elements (keys; also queries unless `query` is given).
        query: LongTensor[Nq] element indices used as queries (default: all, Nq = N).
    """
    q = layout if query is None else layout.select(query)
    return allowed(
        q.anchor[:, None],
        q.depth[:, None],
        q.doc[:, None],
        layout.anchor[None, :],
        layout.depth[None, :],
        layout.doc[None, :],
    )


_compiled_create: Callable[..., Any] | None = None
_compiled_flex: Callable[..., Any] | None = None


def build_block_mask(layout: CODLayout, device: torch.device | str, query: torch.Tensor | None = None) -> Any:
    """A flex-attention BlockMask of the predicate (compiled with dynamic=True; eager if compiling fails).

    Args:
        layout: the elements, on any device (moved to `device`).
        device: where the mask and attention run (CUDA for training).
        query: LongTensor[Nq] element indices used as queries (default: all).
    """
    global _compiled_create
    from torch.nn.attention.flex_attention import create_block_mask

    layout = layout.to(device)
    if query is not None:
        query = query.to(device)
    n_q = len(layout) if query is None else int(query.numel())
    mod = mask_mod(layout, query)
    args: dict[str, Any] = dict(B=None, H=None, Q_LEN=n_q, KV_LEN=len(layout), device=device)
    if torch.device(device).type == "cuda":
        try:
            if _compiled_create is None:
                _compiled_create = torch.compile(create_block_mask, dynamic=True)
            return _compiled_create(mod, **args)
        except Exception as err:  # compile can fail on exotic setups: eager is correct, only slower
            log.warning("compiled create_block_mask failed (%s); using eager", type(err).__name__)
    return create_block_mask(mod, **args)


def build_mask(layout: CODLayout, device: torch.device | str, query: torch.Tensor | None = None) -> AttnMask:
    """The mask for `device`: a BlockMask on CUDA, a dense bool matrix elsewhere (flex has no CPU backward)."""
    if torch.device(device).type == "cuda":
        return build_block_mask(layout, device, query)
    layout = layout.to(device)
    return dense_mask(layout, None if query is None else query.to(device))


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


# Query rows per SDPA call on a dense mask. A packed row's mask is sparse (one sample's elements see only that
# sample's context: about 10 % of the pairs in a 1,024-token row of the demo's data), and the CPU kernel works on
# every (query, key) pair it is given: each block of queries reads only the keys that one of its rows may see.
# The demo's training step ran 1.11x as fast with bf16 blocks of 128 (32 to 256 measured) as in one call, 1.24x in
# fp32 blocks (below; AVX512-BF16 host, docs/guides/train.md).
QUERY_BLOCK = 128
# The keys and values a block gathers are kept for its backward. Their total grows with the context each block
# sees: about 7 times the queries' own size in the demo's rows (chat samples of a few hundred tokens), 20 to 50 times
# in rows of 4096-token samples, where that is quadratic in the sample length (0.9 GB for 2 such samples). Past
# this factor, backward gathers them again and reruns each block's forward (about a fifth of a step).
GATHER_KEEP_FACTOR = 16


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask, scale: float | None = None
) -> torch.Tensor:
    """Masked attention: flex for a BlockMask, SDPA for a dense bool mask (in blocks of `QUERY_BLOCK` queries,
    each over the keys its rows may see).

    Fully masked query rows (padding) give 0 output and 0 gradient, never NaN.

    Args:
        q: [1, Hq, Nq, D]; k, v: [1, Hkv, Nk, D] (Hq a multiple of Hkv: grouped-query attention).
        mask: BoolTensor[Nq, Nk] or a BlockMask of the same shape.
        scale: softmax scale (default 1/sqrt(D)).

    Returns:
        [1, Hq, Nq, D].
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not isinstance(mask, torch.Tensor):
        return _flex(q, k, v, mask, scale)
    if mask.shape[0] <= QUERY_BLOCK:
        return _sdpa(q, *_expand(q, k, v), mask, scale)
    # fp32 inside: each block's key and value gradients are summed over the blocks, which in bf16 would round at
    # every block (a single SDPA call accumulates in fp32). On the CPU measured the fp32 kernel was the faster one.
    # Each block expands the kv heads and casts to fp32 only the keys it reads: an fp32 copy of every key and value
    # at Hq heads, kept for backward, was the largest part of a segment's peak that grew with its context (Hq / Hkv
    # times the keys and values themselves; 38 MiB at 8.7k elements for SmolLM2, docs/guides/train.md).
    dtype = q.dtype
    q = q.float()
    starts = range(0, mask.shape[0], QUERY_BLOCK)
    seen = [mask[s : s + QUERY_BLOCK].any(dim=0) for s in starts]  # BoolTensor[Nk] per block: keys it may see
    gathered = sum(int(x.sum()) for x in seen) * 2  # key and value rows the blocks gather
    recompute = torch.is_grad_enabled() and gathered > GATHER_KEEP_FACTOR * q.shape[2]
    blocks = []
    for start, keys_seen in zip(starts, seen, strict=True):
        rows = mask[start : start + QUERY_BLOCK]  # BoolTensor[b, Nk]
        qb = q[:, :, start : start + QUERY_BLOCK]
        if bool(keys_seen.all()):
            blocks.append(_sdpa(qb, *_expand(qb, k, v), rows, scale))
        elif not bool(keys_seen.any()):  # padding only
            blocks.append(torch.zeros_like(qb))
        elif recompute:  # keep no gathered copy for backward: backward gathers again
            keys = keys_seen.nonzero().squeeze(1)
            blocks.append(checkpoint(_gathered_sdpa, qb, k, v, rows, keys, scale, use_reentrant=False))
        else:
            blocks.append(_gathered_sdpa(qb, k, v, rows, keys_seen.nonzero().squeeze(1), scale))
    return torch.cat(blocks, dim=2).to(dtype)


def _expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [1, Hkv, n, D] at q's heads and dtype (repeated kv heads keep SDPA on its fused CPU kernel, which
    enable_gqa does not)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k.to(q.dtype), v.to(q.dtype)


def _gathered_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """`_sdpa` of a block of queries over only the keys `keys` (LongTensor[n]) that its rows may see."""
    return _sdpa(q, *_expand(q, k.index_select(2, keys), v.index_select(2, keys)), rows[:, keys], scale)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with a dense bool mask [Nq, Nk] over equal head counts; rows with no allowed key give 0."""
    live = mask.any(dim=-1)  # BoolTensor[Nq]
    all_live = bool(live.all())
    if not all_live:
        # A row with no allowed key would softmax over nothing (NaN): let it see key 0, then zero its output.
        mask = mask.clone()
        mask[:, 0] |= ~live
    with torch.autocast(q.device.type, enabled=False):  # in the inputs' dtype (autocast would cast fp32 down)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if not all_live:
        out = out * live.to(out.dtype)[:, None]
    return out
