"""TargetStageConfig: the settings `generate` and `extract` share (both run the target over chat data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from peagle_pipeline.config.fields import (
    gpu_memory_setting,
    setting,
    template_kwargs_setting,
    tensor_parallel_setting,
)

__all__ = ["TargetStageConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetStageConfig:
    """The settings `generate` and `extract` share (both run the target over chat data, rank by rank).

    Each command's own fields follow in its subclass; a shared field whose help differs there is reworded with
    `reword` (its default stays here). `backend` is each command's own: generate defaults to auto (vLLM when
    installed), extract to hf.
    """

    model: str = setting(
        "", "Target model: a local HF model directory (config.json + safetensors + tokenizer).", required=True
    )
    data: list[str] = setting([], "Chat data. Repeatable.", required=True)
    split: str | None = setting(
        None,
        "The split of a Hugging Face DatasetDict (save_to_disk) to read; default train. Only DatasetDict data has splits.",
    )
    output: str = setting("", "Output directory to create or resume.", required=True)
    max_samples: int | None = setting(
        None, "Use only the first N conversations of the data (before rank splitting)."
    )
    rank: int | None = setting(None, "This writer's rank; default from RANK / SLURM_PROCID, else 0.")
    world_size: int | None = setting(
        None, "Number of writers; default from WORLD_SIZE / SLURM_NTASKS, else 1."
    )
    device: str = setting("auto", "Device for the hf backend: auto, cpu, cuda, cuda:N.")
    compute_dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto",
        "Model dtype: auto = bf16 on CUDA or a CPU whose bf16 units run it faster (AMX, or AVX512-BF16 on AMD), else fp32.",
    )
    chat_template_kwargs: dict[str, Any] = template_kwargs_setting()
    tensor_parallel_size: int = tensor_parallel_setting()
    gpu_memory_utilization: float = gpu_memory_setting()
