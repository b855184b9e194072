"""COD (conditional-on-distribution) sampling of P-EAGLE training chains, and the packed element layout.

Pure torch: no I/O, no global RNG (every draw takes an explicit `torch.Generator`), no config objects beyond
`CODConfig`. Sampling runs per sample in shifted coordinates, so a chain never crosses samples.

Worked example (one sample, S = 6, valid V = {1, 2, 3, 4, 5}, K = 3, r = 0.7, r_min = 0.2, no max_anchors draw):
seeds = V = [1, 2, 3, 4, 5]; n_1 = int(4 * 0.7) = 2, say positions [2, 4] are picked (anchors 1, 3);
pool_2 = [3, 5] (both valid); n_2 = int(3 * 0.49) = 1, say [5] (anchor 3). Packed with one padding row (L = 7):

    element   0  1  2  3  4  5  6 | 7  8 | 9
    anchor    0  1  2  3  4  5  6 | 1  3 | 3
    depth     0  0  0  0  0  0  0 | 1  1 | 2
    doc       0  0  0  0  0  0 -1 | 0  0 | 0
    position  0  1  2  3  4  5  0 | 2  4 | 5
    target    0  1  2  3  4  5  6 | 2  4 | 5
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from peagle_pipeline.core.settings import CODConfig
from peagle_pipeline.errors import BadInput

__all__ = ["CODConfig", "CODLayout", "depth_sizes", "sample_chains", "full_chains", "build_layout"]


@dataclass(frozen=True, slots=True)
class CODLayout:
    """The COD elements of one packed row, all LongTensor[N].

    Elements are ordered depth 0 (every packed row, padding included, in row order) then depth 1, 2, ...
    (each depth in packed-row order).
    """

    anchor: torch.Tensor
    """Packed-row index of the chain's anchor (= own row for depth 0)."""
    depth: torch.Tensor
    """Depth in the chain (0 = real token)."""
    doc: torch.Tensor
    """Sample index within the packed row; -1 = padding."""
    position: torch.Tensor
    """RoPE position: anchor's position within its sample + depth."""
    target: torch.Tensor
    """Packed-row index whose target distribution and weight this element predicts (= anchor + depth)."""

    def __len__(self) -> int:
        return int(self.anchor.numel())

    @property
    def rows(self) -> int:
        """Packed-row length L (number of depth-0 elements)."""
        return int((self.depth == 0).sum())

    def select(self, index: torch.Tensor) -> CODLayout:
        """Sub-layout of the elements `index` (LongTensor[n]); anchors keep their packed-row meaning."""
        return CODLayout(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device: torch.device | str) -> CODLayout:
        """The same layout on `device`."""
        return CODLayout(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def element_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """BoolTensor[N]: the loss weight of each element (row weight of its target; padding never counts).

        Args:
            weight: BoolTensor[L], the packed row's shifted loss mask.
        """
        return weight.to(torch.bool)[self.target] & (self.doc >= 0)

    def depth_counts(self, depths: int) -> list[int]:
        """Number of elements at each depth 0..depths-1."""
        return torch.bincount(self.depth, minlength=depths)[:depths].tolist()


def depth_sizes(num_seeds: int, cfg: CODConfig) -> list[int]:
    """Closed-form n_d for d = 1..K-1 (stopping before the first n_d <= 0): what a large pool yields."""
    sizes = []
    for d in range(1, cfg.depths):
        n = int(max(0, num_seeds - d) * max(cfg.ratio**d, cfg.ratio_min))
        if n <= 0:
            break
        sizes.append(n)
    return sizes


def _usable_valid(valid: torch.Tensor) -> torch.Tensor:
    """BoolTensor[S]: valid positions that may be depth >= 1 elements (position 0 never: its anchor is -1)."""
    usable = valid.to(torch.bool).clone()
    if usable.numel():
        usable[0] = False
    return usable


def sample_chains(valid: torch.Tensor, cfg: CODConfig, generator: torch.Generator) -> list[torch.Tensor]:
    """Sample COD positions of one sample (docs/reference/algorithm.md, COD sampling).

    Position 0 is removed from the valid set before anything is drawn, so the `max_anchors` draw is
    `randperm(|V \\ {0}|)` and `|seeds|` in the closed form counts usable seeds. Whenever position 0 is not
    valid (the usual case: shifted row 0 is a prompt token) the draws and the result are bit-identical to the
    reference implementation's for the same generator state.

    Args:
        valid: BoolTensor[S], shifted loss mask of the sample (position i trains target i).
        cfg: COD settings.
        generator: the only source of randomness; advanced in the documented order (one randperm for the seeds, one per sampled depth).

    Returns:
        For depths 1.. in order, LongTensor[n_d] of selected positions (sample coordinates, ascending); the
        anchors of depth d are these minus d. Stops at the first depth with n_d <= 0 (entries may be empty
        when the pool ran dry).
    """
    valid_b = valid.to(torch.bool)
    S = valid_b.numel()
    candidates = torch.nonzero(_usable_valid(valid_b)).flatten()  # LongTensor[|V'|], ascending
    seeds = candidates
    if cfg.max_anchors is not None and candidates.numel() > cfg.max_anchors:
        perm = torch.randperm(candidates.numel(), generator=generator, device=valid_b.device)
        seeds = candidates[perm[: cfg.max_anchors]].sort().values
    pool = seeds
    out: list[torch.Tensor] = []
    for d in range(1, cfg.depths):
        n = int(max(0, seeds.numel() - d) * max(cfg.ratio**d, cfg.ratio_min))
        if n <= 0:
            break
        if pool.numel() >= n:
            perm = torch.randperm(pool.numel(), generator=generator, device=valid_b.device)
            selected = pool[perm[:n]].sort().values
        else:
            selected = pool
        out.append(selected)
        nxt = selected + 1
        nxt = nxt[nxt < S]
        pool = nxt[valid_b[nxt]]
    return out


def full_chains(valid: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """Every chain to full depth, deterministically (evaluation; no max_anchors bound).

    Depth 1 = every usable valid position; depth d = positions p with p-1 at depth d-1 and p valid.

    Args:
        valid: BoolTensor[S].
        depths: K.

    Returns:
        LongTensor[n_d] of selected positions per depth 1..K-1 (sample coordinates, ascending).
    """
    valid_b = valid.to(torch.bool)
    S = valid_b.numel()
    out: list[torch.Tensor] = []
    pool = torch.nonzero(_usable_valid(valid_b)).flatten()
    for _ in range(1, depths):
        out.append(pool)
        nxt = pool + 1
        nxt = nxt[nxt < S]
        pool = nxt[valid_b[nxt]]
    return out


def build_layout(
    doc_lengths: list[int],
    weight: torch.Tensor,
    cfg: CODConfig,
    generator: torch.Generator | None,
    full: bool = False,
) -> CODLayout:
    """Sample the COD elements of one packed row.

    The packed row is the samples (shifted, lengths `doc_lengths`) concatenated, then padding up to
    L = len(weight). Samples are drawn one after the other with the same generator.

    Args:
        doc_lengths: shifted length S of each sample, in packing order.
        weight: BoolTensor[L], shifted loss mask of the packed row (padding rows should be 0).
        cfg: COD settings.
        generator: randomness for sampling (unused and may be None when `full`).
        full: every valid chain to full depth, deterministically (for evaluation / acceptance estimates).

    Returns:
        CODLayout with L depth-0 elements followed by the sampled deeper elements.

    Raises:
        BadInput: the samples do not fit in the row or a length is negative.
    """
    L = int(weight.numel())
    device = weight.device
    if any(n < 0 for n in doc_lengths) or sum(doc_lengths) > L:
        raise BadInput(
            f"samples of lengths {doc_lengths} (total {sum(doc_lengths)}) do not fit a packed row of {L}"
        )
    if not full and generator is None:
        raise BadInput("build_layout needs a torch.Generator unless full=True")
    doc = torch.full((L,), -1, dtype=torch.long, device=device)
    position = torch.zeros(L, dtype=torch.long, device=device)
    per_depth: list[list[torch.Tensor]] = [[] for _ in range(cfg.depths)]
    offset = 0
    for s, n in enumerate(doc_lengths):
        doc[offset : offset + n] = s
        position[offset : offset + n] = torch.arange(n, device=device)
        part = weight[offset : offset + n]
        chains = full_chains(part, cfg.depths) if full else sample_chains(part, cfg, generator)  # type: ignore[arg-type]
        for d, selected in enumerate(chains, start=1):
            per_depth[d].append(selected + offset)
        offset += n
    rows = torch.arange(L, dtype=torch.long, device=device)
    targets = [rows] + [torch.cat(p) if p else rows[:0] for p in per_depth[1:]]
    depth = torch.cat([torch.full_like(t, d) for d, t in enumerate(targets)])
    target = torch.cat(targets)
    return CODLayout(
        anchor=target - depth, depth=depth, doc=doc[target], position=position[target], target=target
    )
