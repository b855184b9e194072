"""What the pipeline knows of a target before it loads: `TargetInfo`, the default aux-layer rule, and the checks
of the aux-layer ids and of top-k against the target (the one home of each; `model_dir.read_target_info` fills a
`TargetInfo` from the model folder, the backends and the extract stage check with these).

Layer ids follow vLLM's convention: 0 is the embedding output, i the residual stream entering decoder layer i, L
(the number of decoder layers) the output of the last one before the final norm. Reads no file, imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peagle_pipeline.errors import BadInput

__all__ = [
    "TargetInfo",
    "DEFAULT_LAYER_RULE",
    "spelled_default_layer_ids",
    "default_layer_ids",
    "check_layer_ids",
    "check_topk",
]


@dataclass(frozen=True)
class TargetInfo:
    """What the runner needs to know about the target before the first batch."""

    name_or_path: str
    architectures: list[str]
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    config: dict[str, Any]


DEFAULT_LAYER_RULE = "[2, L//2, L-3]"
"""The default aux layers, as EAGLE-3 drafts take them: an early, a middle and a late residual stream."""


def spelled_default_layer_ids(num_hidden_layers: int) -> list[int]:
    """The default aux ids as the rule spells them, [2, L//2, L-3]: on a small target they may coincide.

    Example: a 30-layer target gives [2, 15, 27]; a 6-layer one [2, 3, 3].
    """
    L = num_hidden_layers
    return [2, L // 2, L - 3]


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """The default aux ids: `spelled_default_layer_ids` deduplicated, ascending (6 layers: [2, 3])."""
    return sorted(set(spelled_default_layer_ids(num_hidden_layers)))


def check_layer_ids(layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """Sorted unique aux ids, each in 0..L (L = num_hidden_layers).

    Raises:
        BadInput: no id, or an id outside 0..L.
    """
    L = num_hidden_layers
    if not layer_ids:
        raise BadInput(f"no aux layer ids given: name at least one of 0..{L} (the target has {L} layers)")
    bad = sorted({k for k in layer_ids if not 0 <= k <= L})
    if bad:
        raise BadInput(f"layer ids {bad} outside 0..{L} (the target has {L} layers)")
    return sorted(set(layer_ids))


def check_topk(topk: int, vocab_size: int) -> None:
    """Raises BadInput when more top log-probabilities are asked for than the target has tokens."""
    if topk > vocab_size:
        raise BadInput(f"topk {topk} exceeds the target vocabulary ({vocab_size})")
