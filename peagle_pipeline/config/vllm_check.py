"""VllmCheckConfig: the settings of `peagle-pipeline vllm-check` (flags only; no pipeline-file section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from peagle_pipeline.config.checks import check_gpu_memory
from peagle_pipeline.config.fields import (
    ALLOW_OTHER_TARGET_HELP,
    gpu_memory_setting,
    setting,
    tensor_parallel_setting,
)

__all__ = ["VllmCheckConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class VllmCheckConfig:
    """Settings of `peagle-pipeline vllm-check` (flags only). The stage checks them (after checking that vLLM
    imports), so a missing vLLM is reported first."""

    draft: str = setting("", "Exported draft directory.", required=True, argument=True, metavar="DRAFT")
    target: str = setting("", "Target model directory.", required=True, metavar="MODEL")
    prompts: str | None = setting(
        None,
        "Prompt file (JSONL with 'prompt' or chat data), mt-bench, humaneval, heldout:RUN_DIR, or a cache dir "
        "(its held-out split with the default seed).",
    )
    num_prompts: int = setting(8, "Prompts to generate for.")
    max_tokens: int = setting(64, "Tokens generated per prompt.")
    depths: int | None = setting(None, "num_speculative_tokens (default: the draft's K).")
    report: str | None = setting(None, "Write the JSON report (acceptance, mismatches) here.")
    tensor_parallel_size: int = tensor_parallel_setting()
    gpu_memory_utilization: float = gpu_memory_setting()
    dtype: Literal["bf16", "fp32"] = setting(
        "bf16", "Model dtype in vLLM: bf16 or fp32 (fp32 for exact greedy equality)."
    )
    allow_other_target: bool = setting(False, ALLOW_OTHER_TARGET_HELP)

    def __post_init__(self) -> None:
        check_gpu_memory(self)
