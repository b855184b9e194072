"""Sequence partitioning (the P-EAGLE paper's Algorithm 1): split a packed row's COD elements into segments
that each run their own forward and backward, cutting peak memory.

Pure torch: plans index sets only; the caller runs the model on `layout.select(seg.index)` (mask from the
same predicate), the loss on the owned elements, and calls backward itself (so DDP's hooks see every
segment). Rows are split by position into n equal ranges; depth-0 and depth-1 elements belong to the range of
their own row, deeper elements inherit their chain's depth-1 segment; a segment also reads every depth-0
element left of its right boundary as key/value context (no loss). Since depth-0 elements only ever attend
depth-0 elements, every owned element sees exactly the keys it sees in a single pass, so summed segment
losses and gradients equal the single pass.

Example: L = 8, n = 2 (rows 0-3 | 4-7), element (anchor 3, depth 2) belongs to segment 1 (its depth-1 element
is row 4); segment 1 runs depth-0 rows 0..7 (rows 0-3 as context) plus its deeper elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_pipeline.core.cod import CODLayout
from peagle_pipeline.core.mask import build_mask
from peagle_pipeline.errors import BadInput

__all__ = ["Segment", "segment_ids", "plan_segments", "forward_segment"]


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment of a partitioned packed row."""

    index: torch.Tensor
    """LongTensor[n]: elements (indices into the full layout, ascending) the segment runs."""
    owned: torch.Tensor
    """BoolTensor[n]: elements whose loss this segment computes (the rest is key/value context)."""

    @property
    def out_index(self) -> torch.Tensor:
        """LongTensor[m]: positions within `index` of the owned elements (the model's `out_index`)."""
        return torch.nonzero(self.owned).flatten()

    @property
    def owned_elements(self) -> torch.Tensor:
        """LongTensor[m]: owned elements as indices into the full layout."""
        return self.index[self.owned]


def segment_ids(layout: CODLayout, n: int) -> torch.Tensor:
    """LongTensor[N]: segment of each element (rows split into n equal position ranges)."""
    L = layout.rows
    row = layout.anchor + layout.depth.clamp(max=1)  # own row at depth 0/1; the chain's depth-1 row deeper
    return torch.div(row.clamp(max=max(L - 1, 0)) * n, max(L, 1), rounding_mode="floor")


def plan_segments(layout: CODLayout, n: int, element_weight: torch.Tensor | None = None) -> list[Segment]:
    """Partition `layout` into up to n segments (segments that own nothing are left out).

    Args:
        layout: the packed row's elements (depth-0 elements first, as `build_layout` makes them).
        n: number of segments (1 = a single pass).
        element_weight: BoolTensor[N]; when given, only weighted elements are owned (unweighted ones add
            nothing to the loss, so they need no output; they still serve as context).

    Raises:
        BadInput: n < 1.
    """
    if n < 1:
        raise BadInput(f"sequence partitions must be >= 1, got {n}")
    L = layout.rows
    seg = segment_ids(layout, n)
    wanted = (
        torch.ones_like(seg, dtype=torch.bool) if element_weight is None else element_weight.to(torch.bool)
    )
    out = []
    for j in range(n):
        owned = (seg == j) & wanted
        if not bool(owned.any()):
            continue
        right = int(torch.nonzero(seg[:L] == j).max()) + 1 if bool((seg[:L] == j).any()) else 0
        member = owned.clone()
        member[:right] = True  # every depth-0 element left of the right boundary is context
        index = torch.nonzero(member).flatten()
        out.append(Segment(index=index, owned=owned[index]))
    return out


def forward_segment(
    model: torch.nn.Module, layout: CODLayout, segment: Segment, tokens: torch.Tensor, aux_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the draft on one segment; only the owned elements' queries go through the last layer.

    Args:
        model: a `PEagleDraft` or a wrapper of it (DDP): it is called, so wrapper hooks run; the caller
            computes the loss and calls backward.
        layout: the full packed-row layout; segment: one of `plan_segments(layout, ...)`.
        tokens: LongTensor[L] shifted tokens; aux_rows: [L, n_aux*H] aux states (on the model's device).

    Returns:
        (hidden [m, H] of the owned elements, LongTensor[m] their indices into `layout`), for the loss.
    """
    from peagle_pipeline.core.model import Owned, layout_inputs

    device = tokens.device
    sub = layout.select(segment.index).to(device)
    out_index = segment.out_index.to(device)
    layers = len(getattr(model, "module", model).layers)  # type: ignore[arg-type]  # nn.ModuleList
    full = build_mask(sub, device) if layers > 1 else None
    out_mask = build_mask(sub, device, query=out_index)
    hidden = model(**layout_inputs(sub, tokens, aux_rows), attn_mask=full, owned=Owned(out_index, out_mask))
    return hidden, segment.owned_elements.to(device)
