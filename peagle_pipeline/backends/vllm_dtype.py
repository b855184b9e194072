"""Which dtype a vLLM engine runs a target in: the user's choice, but bf16 where vLLM's CPU backend runs nothing else.

vLLM's CPU kernel for linear attention (the Qwen3-Next and Qwen3.5 hybrids) asserts on any dtype but bf16, inside
the engine process. `extract`, `generate` and `evaluate` settle `auto` by the same rule here, before an engine starts,
and `build_llm` refuses an explicit fp32 for such a target on a CPU in one line. Reads the model's config only; never
imports vLLM.
"""

from __future__ import annotations

from typing import Literal

from peagle_pipeline.errors import BadInput
from peagle_pipeline.model_dir import read_config, text_config

__all__ = ["cpu_runs_bf16_only", "bf16_only_reason", "engine_compute_dtype", "CPU_BF16_ONLY"]

# Why `auto` computes in bf16 for a target `cpu_runs_bf16_only` says yes to (the stage's dtype line).
CPU_BF16_ONLY = "auto: vLLM's CPU kernel for linear attention runs bf16 only"


def cpu_runs_bf16_only(model: str) -> bool:
    """Whether vLLM's CPU backend runs `model` in bf16 only: a target with linear-attention layers (the Qwen3-Next
    and Qwen3.5 hybrids), whose CPU kernel asserts on any other dtype. `auto` then means bf16 on a CPU
    (`CPU_BF16_ONLY`), whatever the CPU's bf16 speed."""
    try:
        config = text_config(read_config(model))
    except BadInput:  # not a local model directory: vLLM says what is wrong with it
        return False
    return "linear_attention" in (config.get("layer_types") or [])


def bf16_only_reason(model: str, device: str) -> str | None:
    """Why vLLM runs `model` in bf16 only on `device` (CPU_BF16_ONLY, for the stage's dtype line), or None where
    it runs any dtype. E.g. a Qwen3-Next target on "cpu": CPU_BF16_ONLY; on "cuda" or a Llama target: None."""
    if device.split(":", 1)[0] != "cpu" or not cpu_runs_bf16_only(model):
        return None
    return CPU_BF16_ONLY


def engine_compute_dtype(requested: str, model: str, device: str) -> Literal["bf16", "fp32"]:
    """The dtype a vLLM engine runs `model` in on `device`: `requested`, or for auto bf16 where
    `bf16_only_reason` gives one, else the hardware's choice (`hardware.resolve_compute_dtype`)."""
    from peagle_pipeline.hardware import resolve_compute_dtype

    if requested == "auto" and bf16_only_reason(model, device) is not None:
        return "bf16"
    return resolve_compute_dtype(requested, device)
