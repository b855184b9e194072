"""Draft vocabulary (SPEC §5.3) from supervised-token counts, and the mask-token rule.

Pure torch: no I/O, no tokenizer objects (callers pass the few ids the rule needs).
Example: counts [5, 0, 9, 5] and size 2 keep ids {2, 0} (0 wins the tie with 3 by id) -> ids [0, 2],
d2t [0, 1], t2d [T, F, T, F], target_to_draft [0, -1, 1, -1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_pipeline.errors import BadInput

__all__ = ["DraftVocab", "build_draft_vocab", "choose_mask_token_id"]


@dataclass(frozen=True, slots=True)
class DraftVocab:
    """Mapping between the target vocabulary (V) and the draft vocabulary (Vd)."""

    ids: torch.Tensor
    """LongTensor[Vd]: target id of each draft id, ascending."""
    d2t: torch.Tensor
    """LongTensor[Vd]: offsets, target id = draft id + d2t[draft id] (the exported `d2t`)."""
    t2d: torch.Tensor
    """BoolTensor[V]: whether a target id is in the draft vocabulary (the exported `t2d`)."""
    target_to_draft: torch.Tensor
    """LongTensor[V]: draft id of each target id, -1 outside the draft vocabulary."""

    @property
    def size(self) -> int:
        """Vd."""
        return int(self.ids.numel())

    @property
    def target_size(self) -> int:
        """V."""
        return int(self.t2d.numel())

    @property
    def is_identity(self) -> bool:
        """Vd == V: no mapping is exported."""
        return self.size == self.target_size


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> DraftVocab:
    """The `size` most frequent tokens (ties broken by lower id), sorted ascending.

    Args:
        token_counts: Int/LongTensor[V] (or numpy array) of supervised-token counts.
        size: Vd, capped at V.

    Raises:
        BadInput: size is not positive or the counts are not one-dimensional.
    """
    counts = torch.as_tensor(token_counts).to(torch.long)
    if counts.dim() != 1 or counts.numel() == 0:
        raise BadInput(f"token counts must be a non-empty 1-D array, got shape {tuple(counts.shape)}")
    if size <= 0:
        raise BadInput(f"draft vocabulary size must be positive, got {size}")
    V = counts.numel()
    size = min(size, V)
    # stable sort by descending count keeps ascending id order among equal counts
    order = torch.sort(-counts, stable=True).indices
    ids = order[:size].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    target_to_draft = torch.full((V,), -1, dtype=torch.long)
    target_to_draft[ids] = torch.arange(size)
    return DraftVocab(ids=ids, d2t=ids - torch.arange(size), t2d=t2d, target_to_draft=target_to_draft)


def choose_mask_token_id(
    tokenizer_mask_id: int | None,
    tokenizer_len: int,
    embedding_rows: int,
    pad_id: int | None,
    eos_id: int | None,
) -> tuple[int, str | None]:
    """The token fed at depth >= 1 (SPEC §5.3).

    Rule: the tokenizer's mask token; else the first unused embedding row when the tokenizer is smaller than
    the embedding; else pad, then eos (both with a warning, since those ids also occur as real tokens).

    Returns:
        (mask_token_id, warning or None).

    Raises:
        BadInput: no candidate exists.
    """
    if tokenizer_mask_id is not None and 0 <= tokenizer_mask_id < embedding_rows:
        return int(tokenizer_mask_id), None
    if tokenizer_len < embedding_rows:
        return int(tokenizer_len), None
    for name, tid in (("pad", pad_id), ("eos", eos_id)):
        if tid is not None and 0 <= tid < embedding_rows:
            return int(tid), (
                f"tokenizer has no mask token and no unused embedding row; using the {name} token ({tid}) "
                "as mask_token_id"
            )
    raise BadInput(
        "cannot choose mask_token_id: the tokenizer has no mask, pad or eos token and no unused embedding row"
    )
