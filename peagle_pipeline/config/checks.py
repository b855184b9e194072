"""The value checks the config classes share in `__post_init__`; each raises `BadConfig` naming the setting."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

from peagle_pipeline.errors import BadConfig

__all__ = [
    "check_gpu_memory",
    "require",
    "check_finite",
    "check_device",
    "refuse_duplicate_paths",
    "check_positive",
    "template_kwargs",
]

# apply_chat_template's own arguments and the template's message list: not template variables (nor the clock,
# `strftime_now`, which the renderer sets).
_RESERVED_TEMPLATE_KEYS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
    "padding truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs "
    "strftime_now".split()
)


def check_gpu_memory(cfg: Any) -> None:
    """`cfg.gpu_memory_utilization` must be in (0, 1]."""
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise BadConfig(f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")


def require(value: Any, name: str, flag: str) -> None:
    """A required setting must be given (by `flag` or in the pipeline file)."""
    if not value:
        raise BadConfig(f"missing required setting {name!r}: give {flag} or set {name} in the pipeline file")


def check_finite(cfg: Any) -> None:
    """Every float setting must be a finite number (nan and inf pass `x > 0`-style range checks)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadConfig(f"{f.name} must be a finite number, got {value}")


_DEVICE = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")


def check_device(device: str) -> None:
    """`device` must be auto, cpu, mps, cuda[:N] or xpu[:N]."""
    if not _DEVICE.match(device):
        raise BadConfig(f"device must be auto, cpu, cuda or cuda:N (also mps, xpu, xpu:N); got {device!r}")


def refuse_duplicate_paths(paths: list[str], where: str = "data names", unit: str = "data file") -> None:
    """Two spellings of one path (`d.jsonl`, `./d.jsonl`, its absolute path) would read it twice."""
    seen: dict[str, str] = {}
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            raise BadConfig(
                f"{where} the same {unit.split()[-1]} twice: {seen[key]!r} and {path!r}; give each {unit} once"
            )
        seen[key] = path


def check_positive(cfg: Any, *names: str) -> None:
    """Each setting of `names` must be > 0."""
    for name in names:
        value = getattr(cfg, name)
        if value <= 0:
            raise BadConfig(f"{name} must be positive, got {value}")


def template_kwargs(value: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra variables for the chat template (`{"enable_thinking": false}`): a mapping (a pipeline file) or its
    JSON text (a flag), as vLLM's `chat_template_kwargs`.

    Example: '{"reasoning_effort": "low"}' -> {"reasoning_effort": "low"}; '[1]' and '{"tokenize": true}' raise.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as err:
            raise BadConfig(
                f"{name} must be a JSON object such as '{{\"enable_thinking\": false}}': {err}"
            ) from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadConfig(f"{name} must be a mapping of template variable names to values; got {value!r}")
    reserved = sorted(_RESERVED_TEMPLATE_KEYS.intersection(value))
    if reserved:
        raise BadConfig(
            f"{name}: {', '.join(reserved)} is not a template variable (the chat rendering sets it)"
        )
    return dict(value)
