"""Draft vocabulary from supervised-token counts, and the mask-token rule.

Pure torch: no I/O, no tokenizer objects (callers pass the few ids the rule needs).
Example: counts [5, 0, 9, 5] and size 2 keep ids {2, 0} (0 wins the tie with 3 by id) -> ids [0, 2],
d2t [0, 1], t2d [T, F, T, F], target_to_draft [0, -1, 1, -1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_pipeline.errors import BadInput

__all__ = [
    "DraftVocab",
    "build_draft_vocab",
    "TokenizerFacts",
    "MaskTokenChoice",
    "choose_mask_token_id",
]


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


@dataclass(frozen=True, slots=True)
class TokenizerFacts:
    """What the mask-token rule and its log line need of a tokenizer, without the tokenizer.

    Extraction writes them into the cache (target/tokenizer_facts.json), so `train` never loads a tokenizer (which
    costs ~5 s of imports). Example (SmolLM2): length 49152, mask_id None, special_ids 0..16, reserved_ids {0, 1, 2,
    ...}, pad_id 2, eos_id 2, names {3: "<repo_name>", ...}.
    """

    length: int
    """len(tokenizer): ids at or above it are unused embedding rows."""
    mask_id: int | None
    """The tokenizer's mask token, if it has one."""
    special_ids: tuple[int, ...]
    """Ids of the tokenizer's special (added) tokens."""
    reserved_ids: frozenset[int]
    """bos/eos/pad/unk and every id the chat template itself produces: never a mask token by rule 4."""
    pad_id: int | None
    eos_id: int | None
    names: dict[int, str]
    """Token strings of the special ids and of mask/pad/eos: the ids the rule can pick without an override."""

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (ids sorted, so equal facts give equal bytes)."""
        return {
            "length": self.length,
            "mask_id": self.mask_id,
            "special_ids": sorted(self.special_ids),
            "reserved_ids": sorted(self.reserved_ids),
            "pad_id": self.pad_id,
            "eos_id": self.eos_id,
            "names": {str(i): self.names[i] for i in sorted(self.names)},
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> TokenizerFacts:
        """The inverse of `to_dict`. Raises KeyError, TypeError or ValueError for a malformed dict."""

        def opt(key: str) -> int | None:
            value = d[key]
            return None if value is None else int(value)  # type: ignore[call-overload]

        names = d["names"]
        if not isinstance(names, dict):
            raise TypeError(f"names must be a dict, got {type(names).__name__}")
        return cls(
            length=int(d["length"]),  # type: ignore[call-overload]
            mask_id=opt("mask_id"),
            special_ids=tuple(int(i) for i in d["special_ids"]),  # type: ignore[attr-defined]
            reserved_ids=frozenset(int(i) for i in d["reserved_ids"]),  # type: ignore[attr-defined]
            pad_id=opt("pad_id"),
            eos_id=opt("eos_id"),
            names={int(k): str(v) for k, v in names.items()},
        )


@dataclass(frozen=True, slots=True)
class MaskTokenChoice:
    """The chosen mask token, the rule that chose it, and a warning when the choice is a poor one."""

    token_id: int
    rule: str
    warning: str | None = None


def _chosen_by_setting(override: int, rows: int, counts: torch.Tensor | None) -> MaskTokenChoice:
    """Rule 1: the `mask_token_id` setting, with a warning when the data holds it (counts: LongTensor[V] or None)."""
    if not 0 <= override < rows:
        raise BadInput(f"mask_token_id {override} is outside the target vocabulary (0..{rows - 1})")
    seen = counts is not None and override < counts.numel() and int(counts[override]) > 0
    return MaskTokenChoice(
        int(override),
        "the mask_token_id setting",
        f"mask_token_id {override} occurs {int(counts[override])} times in the data; its embedding will "
        "serve both as a real token and as the mask"
        if seen and counts is not None
        else None,
    )


def choose_mask_token_id(
    facts: TokenizerFacts,
    embedding_rows: int,
    token_counts: torch.Tensor | None = None,
    override: int | None = None,
) -> MaskTokenChoice:
    """The token fed at every depth >= 1 slot; its embedding row is trained as the mask embedding.

    Rule, first match wins: (1) an explicit `override`; (2) the tokenizer's mask token; (3) the first unused
    embedding row when the tokenizer is smaller than the embedding; (4) the lowest-id special token that is not
    reserved (bos/eos/pad/unk, produced by the chat template) and never occurs in the data; (5) pad, then eos,
    with a warning, since those also occur as real tokens.
    Example (SmolLM2): no mask token, tokenizer = embedding = 49152 rows, special ids 0..16 with 0, 1, 2
    reserved (bos/eos/pad and ChatML's <|im_start|>/<|im_end|>) -> id 3 (`<repo_name>`) unless the data holds it.

    Args:
        facts: the tokenizer's facts (TokenizerFacts).
        embedding_rows: rows of the target's embedding matrix (V).
        token_counts: Int/LongTensor[V] of every token in the data (context and supervised), or None (unknown:
            rule 4 is skipped).
        override: an explicit `mask_token_id` setting.

    Raises:
        BadInput: the override is outside the embedding, or no candidate exists.
    """
    rows = embedding_rows
    counts = None if token_counts is None else torch.as_tensor(token_counts).to(torch.long)
    if override is not None:
        return _chosen_by_setting(override, rows, counts)
    if facts.mask_id is not None and 0 <= facts.mask_id < rows:
        return MaskTokenChoice(int(facts.mask_id), "the tokenizer's mask token")
    if facts.length < rows:
        return MaskTokenChoice(int(facts.length), "the first unused embedding row")
    if counts is not None:
        for tid in sorted(set(facts.special_ids)):
            if (
                0 <= tid < min(rows, counts.numel())
                and tid not in facts.reserved_ids
                and int(counts[tid]) == 0
            ):
                return MaskTokenChoice(int(tid), "the lowest unused special token")
    for name, fallback in (("pad", facts.pad_id), ("eos", facts.eos_id)):
        if fallback is not None and 0 <= fallback < rows:
            return MaskTokenChoice(
                int(fallback),
                f"the {name} token",
                f"no mask token, unused embedding row or unused special token; using the {name} token ({fallback}) "
                "as mask_token_id, which also occurs as a real token: set mask_token_id to a better id",
            )
    raise BadInput(
        "cannot choose mask_token_id: the tokenizer has no mask, pad or eos token, no unused embedding row and "
        "no unused special token; set mask_token_id"
    )
