"""GenerateConfig: the settings of `peagle-pipeline generate` (pipeline-file section `generate:`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from peagle_pipeline.config.checks import (
    check_device,
    check_finite,
    check_gpu_memory,
    check_positive,
    require,
)
from peagle_pipeline.config.fields import reword, setting
from peagle_pipeline.config.target_stage import TargetStageConfig
from peagle_pipeline.errors import BadConfig

__all__ = ["GenerateConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateConfig(TargetStageConfig):
    """Settings of `peagle-pipeline generate` (pipeline-file section `generate:`)."""

    data: list[str] = reword(
        TargetStageConfig,
        "data",
        "Chat data whose assistant replies are regenerated (every format extract reads). Repeatable.",
    )
    output: str = reword(
        TargetStageConfig,
        "output",
        "Output directory of on-policy rows to create or resume (extract reads it).",
    )
    backend: Literal["auto", "vllm", "hf"] = setting(
        "auto", "Generation runtime: vllm, hf (transformers), or auto = vllm when installed, else hf."
    )
    turns: Literal["all", "first", "last"] = setting(
        "all",
        "Replies to regenerate: all (turn j sees the target's own earlier replies), first, or last (earlier original replies kept as context).",
    )
    thinking: Literal["strip", "keep"] = setting(
        "strip",
        "turns all: an earlier generated reply with reasoning (<think>...</think>, or gpt-oss's analysis channel) is given to the chat template without it (strip) or whole (keep; Qwen3's and gpt-oss's templates drop it anyway). The newest reply of a row keeps its thinking.",
    )
    temperature: float = setting(
        0.7, "Sampling temperature (0 = greedy; greedy makes small models loop, see docs/guides/generate.md)."
    )
    top_p: float = setting(0.95, "Nucleus sampling: keep the smallest token set of this probability mass.")
    repetition_penalty: float = setting(1.0, "Repetition penalty (1.0 = none; vLLM/transformers semantics).")
    max_new_tokens: int = setting(
        1024, "Most tokens generated per reply; a reply cut here ends its conversation."
    )
    max_prompt_tokens: int = setting(
        1024, "Prompts (conversation so far) longer than this are skipped, with the reason recorded."
    )
    samples_per_prompt: int = setting(
        1, "Independent conversations generated per source conversation (more than 1 needs temperature > 0)."
    )
    seed: int = setting(0, "Sampling seed; each (row, sample, turn) draws from its own seed derived from it.")
    chunk_size: int = setting(
        64, "Source conversations per committed chunk (generated together; the unit of resume)."
    )
    batch_size: int | None = setting(
        None,
        "hf backend: replies decoded together (default: as many as the free GPU memory holds, 16 on a CPU; vLLM schedules its own).",
    )

    def __post_init__(self) -> None:
        require(self.model, "model", "--model")
        require(self.data, "data", "--data")
        require(self.output, "output", "--output")
        check_finite(self)
        check_device(self.device)
        check_positive(
            self,
            "max_new_tokens",
            "max_prompt_tokens",
            "samples_per_prompt",
            "chunk_size",
            "tensor_parallel_size",
            "repetition_penalty",
        )
        if self.max_samples is not None and self.max_samples <= 0:
            raise BadConfig(f"max_samples must be positive, got {self.max_samples}")
        if self.batch_size is not None and self.batch_size <= 0:
            raise BadConfig(f"batch_size must be positive, got {self.batch_size}")
        if self.temperature < 0:
            raise BadConfig(f"temperature must be >= 0, got {self.temperature}")
        # greedy: every sample of a prompt would be the same reply
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise BadConfig(
                f"samples_per_prompt {self.samples_per_prompt} with temperature 0 (greedy) gives identical samples; "
                "set temperature > 0 to sample, or samples_per_prompt 1"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise BadConfig(f"top_p must be in (0, 1], got {self.top_p}")
        check_gpu_memory(self)
