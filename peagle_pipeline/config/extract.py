"""ExtractConfig: the settings of `peagle-pipeline extract` (pipeline-file section `extract:`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from peagle_pipeline.config.checks import (
    check_device,
    check_finite,
    check_gpu_memory,
    check_positive,
    refuse_duplicate_paths,
    require,
)
from peagle_pipeline.config.fields import reword, setting
from peagle_pipeline.config.target_stage import TargetStageConfig
from peagle_pipeline.errors import BadConfig

__all__ = ["ExtractConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractConfig(TargetStageConfig):
    """Settings of `peagle-pipeline extract` (pipeline-file section `extract:`)."""

    data: list[str] = reword(
        TargetStageConfig,
        "data",
        "Dataset files or HF datasets saved to disk (ShareGPT or OpenAI messages; JSON, JSONL, Parquet). Repeatable.",
    )
    output: str = reword(TargetStageConfig, "output", "Cache directory to create or resume.")
    backend: Literal["hf", "vllm"] = setting("hf", "Target runtime: hf (transformers) or vllm.")
    layers: list[int] | None = setting(
        None,
        "Aux hidden-state layer ids in vLLM convention (0 = embeddings), comma-separated; default 2, L//2, L-3.",
        comma=True,
    )
    topk: int = setting(
        32, "Number of top target log-probabilities kept per token (over the full target vocabulary)."
    )
    last_hidden: bool = setting(
        False, "Also store the pre-norm last hidden state (layer id L), enabling exact targets."
    )
    max_length: int = setting(
        2048, "Maximum tokens per sample; longer samples are truncated or skipped (see overlong)."
    )
    overlong: Literal["truncate", "skip"] = setting(
        "truncate", "What to do with samples longer than max_length."
    )
    batch_tokens: int = setting(8192, "Padded tokens per forward batch.")
    length_window: int | None = setting(
        None,
        "Sort each window of this many consecutive samples by length before batching, so batches pad little (the storage order follows; 1 = row order). Default: 256 for a new cache; a resumed cache keeps the order it was started with.",
    )
    dtype: Literal["bf16", "fp32", "fp8", "nf4"] = setting(
        "bf16",
        "Stored hidden-state dtype (the forward's is compute_dtype). fp8: lossy, about half the bytes of bf16 (e4m3 with an fp32 scale per token and layer, read back as bf16). nf4: lossy, about 0.28x the bytes of bf16 (4-bit NF4 in blocks of 32 with fp8 block scales and 4 bf16 outliers per token and layer, read back as bf16; the hidden size must be a multiple of 32). See docs/reference/cache-format.md.",
    )
    compute_dtype: Literal["auto", "bf16", "fp32"] = reword(
        TargetStageConfig,
        "compute_dtype",
        "Target forward dtype. auto: fp32 when dtype is fp32, else bf16 on CUDA and on CPUs whose bf16 units run it faster (AMX, or AVX512-BF16 on AMD), fp32 on other CPUs; a resumed cache keeps the dtype it was started with.",
    )
    assistant_turns: Literal["all", "last"] = setting(
        "all",
        "Supervise all assistant turns or only the last one (of a token-id row: its last run of supervised tokens).",
    )
    leading_assistant: Literal["context", "drop"] = setting(
        "context", "An assistant turn before any user turn: keep as unsupervised context, or drop it."
    )
    compress: Literal["auto", "zstd", "none"] = setting(
        "auto",
        "Zarr shard compression: auto = zstd for ids, mask and top-k log-probs, blosc-lz4 for top-k ids, raw + crc32c for hidden states (memcpy-speed reads, checked on every read); zstd = zstd level 3 for every array (smaller, ~10x slower reads); none = raw, no per-chunk checksum.",
    )
    shard_tokens: int = setting(
        16384, "Tokens per Zarr shard (one file per array per shard; the unit of commit)."
    )
    chunk_tokens: int = setting(
        128, "Tokens per inner Zarr chunk (the unit of a random read and of the crc32c check)."
    )
    topk_chunk: int = setting(1024, "Tokens per chunk of the log-softmax/top-k computation (bounds memory).")
    max_num_batched_tokens: int | None = setting(None, "vLLM scheduler token budget per step.")
    space_check: bool = setting(
        True,
        "Before the target loads, refuse to start when the output's file system has less free space than the estimated cache size (less what the output already holds) plus 10 %; an object-store output is not checked. --no-space-check starts anyway.",
    )
    allow_other_target: bool = setting(
        False,
        "Extract a generate output made by another target (its recorded config.json or tokenizer differ from "
        "model's): a warning instead of a refusal.",
    )

    def __post_init__(self) -> None:
        check_finite(self)
        check_device(self.device)
        require(self.model, "model", "--model")
        require(self.data, "data", "--data")
        require(self.output, "output", "--output")
        check_positive(
            self,
            "topk",
            "max_length",
            "batch_tokens",
            "shard_tokens",
            "chunk_tokens",
            "topk_chunk",
            "tensor_parallel_size",
        )
        if self.max_samples is not None and self.max_samples <= 0:
            raise BadConfig(f"max_samples must be positive, got {self.max_samples}")
        if self.length_window is not None and self.length_window <= 0:
            raise BadConfig(f"length_window must be positive, got {self.length_window}")
        if self.shard_tokens % self.chunk_tokens:
            raise BadConfig(
                f"shard_tokens ({self.shard_tokens}) must be a multiple of chunk_tokens ({self.chunk_tokens})"
            )
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise BadConfig(f"layers must be non-negative layer ids, got {self.layers}")
        layers = self.layers or []
        twice = next((k for i, k in enumerate(layers) if k in layers[:i]), None)
        if twice is not None:
            raise BadConfig(f"layers names layer {twice} twice ({self.layers}); give each layer id once")
        refuse_duplicate_paths(self.data)
        check_gpu_memory(self)
