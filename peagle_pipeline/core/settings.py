"""Settings of the pure core as small frozen dataclasses: importable without torch, so `config/` takes their
defaults and checks from here (each defined once). Pure: no I/O, no torch."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from peagle_pipeline.errors import BadConfig

__all__ = [
    "CODConfig",
    "SERVING_DEPTHS",
    "TENSOR_PARALLEL_SIZE",
    "GPU_MEMORY_UTILIZATION",
    "setting_differences",
]

# K that vLLM drafts with by default: the export's `speculative_tokens`, at most the K the draft was trained with
# (`CODConfig.depths`). P-EAGLE trains deeper than it serves: trained at K = 8 and served at K = 5, a draft beats
# one trained at K = 5 by 3-4 % (the paper); the deeper positions are cheap to train (COD keeps few of them).
SERVING_DEPTHS = 4

# The vLLM engine defaults of every command that starts an engine (generate, extract, evaluate, vllm-check) and of
# the backends' own settings: defined once here, where both config/ and backends/ may import them.
TENSOR_PARALLEL_SIZE = 1
"""GPUs one vLLM engine is split over (tensor parallelism)."""
GPU_MEMORY_UTILIZATION = 0.9
"""Fraction of each GPU's memory a vLLM engine may take."""


@dataclass(frozen=True, slots=True)
class CODConfig:
    """COD sampling settings (docs/reference/algorithm.md)."""

    depths: int = 8
    """K: elements per chain (depth 0 .. K-1); trained deeper than served (`SERVING_DEPTHS`)."""
    ratio: float = 0.7
    """r: depth d keeps about r**d of the seeds."""
    ratio_min: float = 0.2
    """r_min: floor of the kept fraction per depth."""
    max_anchors: int | None = 512
    """At most this many seeds per sample (bounds depths >= 1 only); None = no bound."""

    def __post_init__(self) -> None:
        # Messages name the pipeline-file settings (`TrainConfig` validates through this class).
        if self.depths < 1:
            raise BadConfig(f"depths must be positive, got {self.depths}")
        if not 0.0 < self.ratio <= 1.0 or not 0.0 <= self.ratio_min <= 1.0:
            raise BadConfig(
                "down_sample_ratio must be in (0, 1] and down_sample_ratio_min in [0, 1], "
                f"got {self.ratio}, {self.ratio_min}"
            )
        if self.max_anchors is not None and self.max_anchors < 1:
            raise BadConfig(f"max_anchors must be positive, got {self.max_anchors}")


def setting_differences(
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    *,
    ignore: Collection[str] = (),
    ordered: bool = False,
    nested: bool = False,
) -> list[tuple[str, Any, Any]]:
    """The saved-vs-current settings comparison of every resume: (name, saved value, current value) of each
    setting that differs (one missing on a side reads None there), names in `ignore` left out.

    Order: `saved`'s names, then names only `now` has; `ordered` sorts the names (at every level). `nested`
    compares two dict values name by name, reported as `outer.inner`.
    """
    names = [*saved, *(k for k in now if k not in saved)]
    out: list[tuple[str, Any, Any]] = []
    for name in sorted(names) if ordered else names:
        if name in ignore:
            continue
        a, b = saved.get(name), now.get(name)
        if nested and isinstance(a, dict) and isinstance(b, dict):
            inner = setting_differences(a, b, ordered=ordered, nested=True)
            out += [(f"{name}.{k}", x, y) for k, x, y in inner]
        elif a != b:
            out.append((name, a, b))
    return out
