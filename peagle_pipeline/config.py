"""Every setting of the stages, in one place: frozen dataclasses shared by CLI flags and pipeline files.

YAML keys equal flag names with `-` replaced by `_` (`--draft-vocab-size` <-> `draft_vocab_size`), flat under
`generate:` / `extract:` / `train:`. Precedence: default < pipeline file < flag, applied by `resolve()`. Each field's `help`
metadata is its one-line documentation (the CLI help and docs/reference/pipeline-files.md are generated from
it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from peagle_pipeline.core.settings import (
    GPU_MEMORY_UTILIZATION,
    SERVING_DEPTHS,
    TENSOR_PARALLEL_SIZE,
    CODConfig,
)
from peagle_pipeline.errors import BadConfig, BadInput

__all__ = [
    "GenerateConfig",
    "ExtractConfig",
    "TrainConfig",
    "TargetStageConfig",
    "EvaluateConfig",
    "VllmCheckConfig",
    "resolve",
    "load_section",
    "to_dict",
    "describe_fields",
    "is_required",
    "field_choices",
    "SERVING_DEPTHS",
]


# The COD defaults are CODConfig's (defined once, in core/settings.py).
_COD = {f.name: f.default for f in dataclasses.fields(CODConfig)}


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _tensor_parallel_field() -> Any:
    """`tensor_parallel_size` of every command that starts a vLLM engine (its value: core/settings.py)."""
    return _f(TENSOR_PARALLEL_SIZE, "vLLM tensor parallel size.")


def _gpu_memory_field() -> Any:
    """`gpu_memory_utilization` of every command that starts a vLLM engine (its value: core/settings.py);
    checked by `_check_gpu_memory`."""
    return _f(GPU_MEMORY_UTILIZATION, "vLLM GPU memory fraction.")


def _reword(base: type, name: str, help: str) -> Any:
    """Field `name` of `base` with this command's own help text (same default, same metadata otherwise)."""
    f = {f.name: f for f in dataclasses.fields(base)}[name]
    kw = {k: v for k, v in f.metadata.items() if k != "help"}
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata={**kw, "help": help})
    return field(default=f.default, metadata={**kw, "help": help})


def _check_gpu_memory(cfg: Any) -> None:
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise BadConfig(f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetStageConfig:
    """The settings `generate` and `extract` share (both run the target over chat data, rank by rank).

    Each command's own fields follow in its subclass; a shared field whose help differs there is reworded with
    `_reword` (its default stays here). `backend` is each command's own: generate defaults to auto (vLLM when
    installed), extract to hf.
    """

    model: str = _f(
        "", "Target model: a local HF model directory (config.json + safetensors + tokenizer).", required=True
    )
    data: list[str] = _f([], "Chat data. Repeatable.", required=True)
    split: str | None = _f(
        None,
        "The split of a Hugging Face DatasetDict (save_to_disk) to read; default train. Only DatasetDict data has splits.",
    )
    output: str = _f("", "Output directory to create or resume.", required=True)
    max_samples: int | None = _f(
        None, "Use only the first N conversations of the data (before rank splitting)."
    )
    rank: int | None = _f(None, "This writer's rank; default from RANK / SLURM_PROCID, else 0.")
    world_size: int | None = _f(None, "Number of writers; default from WORLD_SIZE / SLURM_NTASKS, else 1.")
    device: str = _f("auto", "Device for the hf backend: auto, cpu, cuda, cuda:N.")
    compute_dtype: Literal["auto", "bf16", "fp32"] = _f(
        "auto", "Model dtype: auto = bf16 on CUDA or a CPU with bf16 units (AMX/AVX512-BF16), else fp32."
    )
    tensor_parallel_size: int = _tensor_parallel_field()
    gpu_memory_utilization: float = _gpu_memory_field()


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateConfig(TargetStageConfig):
    """Settings of `peagle-pipeline generate` (pipeline-file section `generate:`)."""

    data: list[str] = _reword(
        TargetStageConfig,
        "data",
        "Chat data whose assistant replies are regenerated (every format extract reads). Repeatable.",
    )
    output: str = _reword(
        TargetStageConfig,
        "output",
        "Output directory of on-policy rows to create or resume (extract reads it).",
    )
    backend: Literal["auto", "vllm", "hf"] = _f(
        "auto", "Generation runtime: vllm, hf (transformers), or auto = vllm when installed, else hf."
    )
    turns: Literal["all", "first", "last"] = _f(
        "all",
        "Replies to regenerate: all (turn j sees the target's own earlier replies), first, or last (earlier original replies kept as context).",
    )
    thinking: Literal["strip", "keep"] = _f(
        "strip",
        "turns all: an earlier generated reply with reasoning (<think>...</think>) is given to the chat template without it (strip) or whole (keep; Qwen3's template strips it anyway). The newest reply of a row keeps its thinking.",
    )
    temperature: float = _f(
        0.7, "Sampling temperature (0 = greedy; greedy makes small models loop, see docs/guides/generate.md)."
    )
    top_p: float = _f(0.95, "Nucleus sampling: keep the smallest token set of this probability mass.")
    repetition_penalty: float = _f(1.0, "Repetition penalty (1.0 = none; vLLM/transformers semantics).")
    max_new_tokens: int = _f(1024, "Most tokens generated per reply; a reply cut here ends its conversation.")
    max_prompt_tokens: int = _f(
        1024, "Prompts (conversation so far) longer than this are skipped, with the reason recorded."
    )
    samples_per_prompt: int = _f(
        1, "Independent conversations generated per source conversation (more than 1 needs temperature > 0)."
    )
    seed: int = _f(0, "Sampling seed; each (row, sample, turn) draws from its own seed derived from it.")
    chunk_size: int = _f(
        64, "Source conversations per committed chunk (generated together; the unit of resume)."
    )
    batch_size: int | None = _f(
        None,
        "hf backend: replies decoded together (default: as many as the free GPU memory holds, 16 on a CPU; vLLM schedules its own).",
    )

    def __post_init__(self) -> None:
        _require(self.model, "model", "--model")
        _require(self.data, "data", "--data")
        _require(self.output, "output", "--output")
        _finite(self)
        _device(self.device)
        _positive(
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
        _check_gpu_memory(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractConfig(TargetStageConfig):
    """Settings of `peagle-pipeline extract` (pipeline-file section `extract:`)."""

    data: list[str] = _reword(
        TargetStageConfig,
        "data",
        "Dataset files or HF datasets saved to disk (ShareGPT or OpenAI messages; JSON, JSONL, Parquet). Repeatable.",
    )
    output: str = _reword(TargetStageConfig, "output", "Cache directory to create or resume.")
    backend: Literal["hf", "vllm"] = _f("hf", "Target runtime: hf (transformers) or vllm.")
    layers: list[int] | None = _f(
        None, "Aux hidden-state layer ids in vLLM convention (0 = embeddings); default 2, L//2, L-3."
    )
    topk: int = _f(
        32, "Number of top target log-probabilities kept per token (over the full target vocabulary)."
    )
    last_hidden: bool = _f(
        False, "Also store the pre-norm last hidden state (layer id L), enabling exact targets."
    )
    max_length: int = _f(
        2048, "Maximum tokens per sample; longer samples are truncated or skipped (see overlong)."
    )
    overlong: Literal["truncate", "skip"] = _f("truncate", "What to do with samples longer than max_length.")
    batch_tokens: int = _f(8192, "Padded tokens per forward batch.")
    length_window: int | None = _f(
        None,
        "Sort each window of this many consecutive samples by length before batching, so batches pad little (the storage order follows; 1 = row order). Default: 256 for a new cache; a resumed cache keeps the order it was started with.",
    )
    dtype: Literal["bf16", "fp32", "fp8"] = _f(
        "bf16",
        "Stored hidden-state dtype (the forward's is compute_dtype). fp8: lossy, about half the bytes of bf16 (e4m3 with an fp32 scale per token and layer, read back as bf16; see docs/reference/cache-format.md).",
    )
    compute_dtype: Literal["auto", "bf16", "fp32"] = _reword(
        TargetStageConfig,
        "compute_dtype",
        "Target forward dtype. auto: fp32 when dtype is fp32, else bf16 on CUDA and on CPUs with bf16 units (AMX / AVX512-BF16), fp32 on other CPUs (faster there); a resumed cache keeps the dtype it was started with.",
    )
    assistant_turns: Literal["all", "last"] = _f(
        "all",
        "Supervise all assistant turns or only the last one (of a token-id row: its last run of supervised tokens).",
    )
    leading_assistant: Literal["context", "drop"] = _f(
        "context", "An assistant turn before any user turn: keep as unsupervised context, or drop it."
    )
    compress: Literal["auto", "zstd", "none"] = _f(
        "auto",
        "Zarr shard compression: auto = zstd for ids, mask and top-k log-probs, blosc-lz4 for top-k ids, raw + crc32c for hidden states (memcpy-speed reads, checked on every read); zstd = zstd level 3 for every array (smaller, ~10x slower reads); none = raw, no per-chunk checksum.",
    )
    shard_tokens: int = _f(16384, "Tokens per Zarr shard (one file per array per shard; the unit of commit).")
    chunk_tokens: int = _f(
        128, "Tokens per inner Zarr chunk (the unit of a random read and of the crc32c check)."
    )
    topk_chunk: int = _f(1024, "Tokens per chunk of the log-softmax/top-k computation (bounds memory).")
    max_num_batched_tokens: int | None = _f(None, "vLLM scheduler token budget per step.")

    def __post_init__(self) -> None:
        _finite(self)
        _device(self.device)
        _require(self.model, "model", "--model")
        _require(self.data, "data", "--data")
        _require(self.output, "output", "--output")
        _positive(
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
        _refuse_duplicate_paths(self.data)
        _check_gpu_memory(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Settings of `peagle-pipeline train` (pipeline-file section `train:`)."""

    cache: str = _f("", "Cache directory written by `peagle-pipeline extract`.", required=True)
    extra_cache: list[str] = _f(
        [],
        "Further caches of the same target (same top-k and stored dtype) whose every sample trains beside cache's "
        "training split; the held-out split, the target's files and the run's identity stay cache's. Repeatable.",
    )
    output: str = _f("", "Run directory (checkpoints, metrics, plots, export).", required=True)
    draft_layers: int = _f(1, "Decoder layers of the draft (the first is the fused EAGLE-3 layer).")
    depths: int = _f(
        _COD["depths"],
        f"K trained: tokens drafted in parallel (COD depths 0..K-1). The export serves at most this many (default "
        f"{SERVING_DEPTHS}: train deeper than you serve, `export --speculative-tokens`).",
    )
    draft_vocab_size: int = _f(
        32000, "Draft vocabulary size (most frequent supervised tokens); capped at the target vocabulary."
    )
    tokens_per_step: int = _f(
        8192, "Packing budget: shifted tokens per packed row (per rank and micro-step)."
    )
    epochs: int = _f(1, "Passes over the training split (ignored when steps is set).")
    steps: int | None = _f(None, "Optimizer steps to run (overrides epochs).")
    lr: float = _f(6e-4, "Peak learning rate (AdamW).")
    warmup: int = _f(50, "Linear warm-up steps.")
    schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "Learning-rate decay after warm-up.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    grad_clip: float = _f(1.0, "Gradient-norm clip (0 disables).")
    down_sample_ratio: float = _f(_COD["ratio"], "COD ratio r: depth d keeps about r**d of the anchors.")
    down_sample_ratio_min: float = _f(_COD["ratio_min"], "COD floor r_min of the kept fraction per depth.")
    max_anchors: int = _f(_COD["max_anchors"], "At most this many COD seeds per sample (depth >= 1 only).")
    sequence_partitions: int = _f(
        1, "Split each packed row into this many segments (forward+backward each) to cut memory."
    )
    grad_checkpointing: bool = _f(False, "Recompute each draft layer in backward (activation checkpointing).")
    target: Literal["topk", "exact"] = _f(
        "topk", "Training target: renormalised stored top-k, or exact from the stored last hidden state."
    )
    loss_positions: Literal["assistant", "all"] = _f(
        "assistant",
        "Positions the training loss covers: assistant (the cache's loss mask: the replies) or all (every position, "
        "prompt tokens too; the target's next-token distribution is a valid target everywhere, so each cached token "
        "teaches). The held-out figures always use the loss mask.",
    )
    eval_samples: int = _f(
        64,
        "Held-out samples (fixed by seed) for agreement and acceptance estimates; training samples with the prompt "
        "of a held-out sample (in any cache) do not train.",
    )
    eval_cache: str = _f(
        "",
        "Cache whose held-out samples give the held-out loss, agreement and estimated AL (default: the training "
        "cache's own held-out split). Same target required. Give one on-policy cache to compare drafts trained on "
        "different data on one held-out set (off-policy validation overstates quality); every sample of the training "
        "cache then trains, except those with a held-out sample's prompt.",
    )
    eval_every: int = _f(100, "Evaluate every N steps (and always at the end).")
    seed: int = _f(0, "Seed of the shuffle, the held-out split, COD sampling and the draft init.")
    save_every: int = _f(200, "Write a checkpoint every N steps (and always at the end).")
    keep_checkpoints: int = _f(2, "Step checkpoints kept on disk (the best one is kept apart).")
    precision: Literal["auto", "bf16", "fp32"] = _f(
        "auto",
        "Compute precision: bf16 autocast or full fp32 (master weights stay fp32); auto = bf16 on CUDA and on CPUs with bf16 units (AMX / AVX512-BF16), fp32 on other CPUs.",
    )
    device: str = _f("auto", "auto, cpu, cuda, cuda:N (under torchrun, cuda:LOCAL_RANK).")
    fsdp: bool = _f(
        False,
        "Under torchrun: shard the draft's trainable parameters, gradients and optimizer state over the ranks "
        "(torch FSDP2) instead of keeping a replica on each (DDP); same updates, same checkpoints.",
    )
    resume: bool = _f(False, "Continue the run in output from its latest complete checkpoint.")
    num_workers: int = _f(1, "DataLoader worker processes reading the cache.")
    loss_chunk: int = _f(2048, "Elements per chunk of the KL computation (bounds [elements, Vd] memory).")
    norm_before_residual: bool = _f(
        False, "Fused layer 0: residual is the normed hidden instead of fc output."
    )
    init_from_target: bool = _f(
        True,
        "Start the fused layer from the target's last decoder layer (stored in the cache) and fc as a "
        "pass-through of the last aux state; off (or a cache without that layer): random init.",
    )
    mask_token_id: int | None = _f(
        None,
        "Token fed at depth >= 1 slots; default by rule: the tokenizer's mask token, an unused embedding row, "
        "else the lowest special token never seen in the data (SPEC 5.3).",
    )
    skip_corrupt: bool = _f(
        False, "Skip samples whose data fails its checksum (reported) instead of stopping."
    )
    max_bad_steps: int = _f(5, "Stop after this many consecutive steps with non-finite loss or gradients.")
    log_every: int = _f(10, "Log metrics every N steps.")
    export: bool = _f(True, "Export the speculators P-EAGLE checkpoint at the end of training.")

    def __post_init__(self) -> None:
        _finite(self)
        _device(self.device)
        _require(self.cache, "cache", "--cache")
        _require(self.output, "output", "--output")
        _refuse_duplicate_paths([self.cache, *self.extra_cache], "cache and extra_cache name", "cache")
        _positive(
            self,
            "draft_layers",
            "draft_vocab_size",
            "tokens_per_step",
            "epochs",
            "sequence_partitions",
            "eval_every",
            "save_every",
            "keep_checkpoints",
            "loss_chunk",
            "max_bad_steps",
            "log_every",
        )
        if self.steps is not None and self.steps <= 0:
            raise BadConfig(f"steps must be positive, got {self.steps}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise BadConfig(f"mask_token_id must be a token id (>= 0), got {self.mask_token_id}")
        if self.lr <= 0:
            raise BadConfig(f"lr must be positive, got {self.lr}")
        self.cod()  # depths, down_sample_ratio(_min) and max_anchors are checked by CODConfig
        for name in ("warmup", "eval_samples", "num_workers", "grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                raise BadConfig(f"{name} must be >= 0, got {getattr(self, name)}")

    def cod(self) -> CODConfig:
        """The COD sampling settings of this run (core.cod's own section)."""
        return CODConfig(
            depths=self.depths,
            ratio=self.down_sample_ratio,
            ratio_min=self.down_sample_ratio_min,
            max_anchors=self.max_anchors,
        )


_ALLOW_OTHER_TARGET = (
    "Run a draft on a target whose config.json or tokenizer differ from the one it was trained on (a warning "
    "instead of a refusal)."
)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvaluateConfig:
    """Settings of `peagle-pipeline evaluate` (flags only; no pipeline-file section). Every figure in the report
    carries them. Its checks raise `BadInput` naming the flag."""

    drafts: list[str] = _f([], "Exported draft directories, measured side by side.", argument=True)
    target: str | None = _f(None, "Target model directory (default: the verifier the draft names).")
    prompts: list[str] = _f(
        ["mt-bench"],
        "Prompt set, repeatable: mt-bench (80 first turns), humaneval (164 problems), heldout:RUN_DIR (the run's "
        "held-out split), or a file (JSONL of {'prompt': ...} or chat data).",
    )
    num_prompts: int = _f(80, "Prompts per set (the first ones).")
    max_tokens: int = _f(256, "Most new tokens generated per prompt.")
    temperature: float = _f(0.0, "Sampling temperature (0 = greedy).")
    depths: int | None = _f(None, "K = num_speculative_tokens (default: each draft's own K).")
    concurrency: list[int] = _f([1], "Requests in flight for the tokens/s figures, repeatable.")
    acceptance_concurrency: int = _f(
        1,
        "Requests in flight in the run AL is read from (1 = one prompt at a time, as peers report; more is faster "
        "on many prompts, with the same AL up to numerics).",
    )
    output: str | None = _f(None, "Directory for report.json and acceptance.png (default: print only).")
    dtype: Literal["auto", "bf16", "fp32"] = _f(
        "auto", "Model dtype in vLLM; auto = bf16 on a GPU or a CPU with bf16 units, else fp32."
    )
    seed: int = _f(0, "Sampling seed of prompt i is seed + i (T > 0).")
    tensor_parallel_size: int = _tensor_parallel_field()
    gpu_memory_utilization: float = _gpu_memory_field()
    allow_other_target: bool = _f(False, _ALLOW_OTHER_TARGET)

    def __post_init__(self) -> None:
        if not self.drafts:
            raise BadInput("give at least one exported draft directory")
        if not self.prompts:
            raise BadInput(
                "give at least one prompt set (--prompts mt-bench, humaneval, heldout:RUN_DIR or a file)"
            )
        for name in ("num_prompts", "max_tokens", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise BadInput(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.depths is not None and self.depths <= 0:
            raise BadInput(f"--depths must be positive, got {self.depths}")
        if not self.concurrency or min(self.concurrency) <= 0:
            raise BadInput(f"--concurrency must be positive, got {self.concurrency}")
        if self.acceptance_concurrency <= 0:
            raise BadInput(f"--acceptance-concurrency must be positive, got {self.acceptance_concurrency}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadInput(f"--temperature must be >= 0, got {self.temperature}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise BadInput(f"--dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        _check_gpu_memory(self)

    @property
    def levels(self) -> list[int]:
        """Every concurrency measured: the tokens/s levels and the one AL is read from."""
        return sorted(set(self.concurrency) | {self.acceptance_concurrency})


@dataclass(frozen=True, kw_only=True, slots=True)
class VllmCheckConfig:
    """Settings of `peagle-pipeline vllm-check` (flags only). The stage checks them (after checking that vLLM
    imports), so a missing vLLM is reported first."""

    draft: str = _f("", "Exported draft directory.", required=True, argument=True, metavar="DRAFT")
    target: str = _f("", "Target model directory.", required=True, metavar="MODEL")
    prompts: str | None = _f(
        None,
        "Prompt file (JSONL with 'prompt' or chat data), mt-bench, humaneval, heldout:RUN_DIR, or a cache dir "
        "(its held-out split with the default seed).",
    )
    num_prompts: int = _f(8, "Prompts to generate for.")
    max_tokens: int = _f(64, "Tokens generated per prompt.")
    depths: int | None = _f(None, "num_speculative_tokens (default: the draft's K).")
    report: str | None = _f(None, "Write the JSON report (acceptance, mismatches) here.")
    tensor_parallel_size: int = _tensor_parallel_field()
    gpu_memory_utilization: float = _gpu_memory_field()
    dtype: Literal["bf16", "fp32"] = _f(
        "bf16", "Model dtype in vLLM: bf16 or fp32 (fp32 for exact greedy equality)."
    )
    allow_other_target: bool = _f(False, _ALLOW_OTHER_TARGET)

    def __post_init__(self) -> None:
        _check_gpu_memory(self)


def _require(value: Any, name: str, flag: str) -> None:
    if not value:
        raise BadConfig(f"missing required setting {name!r}: give {flag} or set {name} in the pipeline file")


def _finite(cfg: Any) -> None:
    """Every float setting must be a finite number (nan and inf pass `x > 0`-style range checks)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadConfig(f"{f.name} must be a finite number, got {value}")


_DEVICE = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")


def _device(device: str) -> None:
    if not _DEVICE.match(device):
        raise BadConfig(f"device must be auto, cpu, cuda or cuda:N (also mps, xpu, xpu:N); got {device!r}")


def _refuse_duplicate_paths(paths: list[str], where: str = "data names", unit: str = "data file") -> None:
    """Two spellings of one path (`d.jsonl`, `./d.jsonl`, its absolute path) would read it twice."""
    seen: dict[str, str] = {}
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            raise BadConfig(
                f"{where} the same {unit.split()[-1]} twice: {seen[key]!r} and {path!r}; give each {unit} once"
            )
        seen[key] = path


def _positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value <= 0:
            raise BadConfig(f"{name} must be positive, got {value}")


C = TypeVar("C", GenerateConfig, ExtractConfig, TrainConfig)
SECTIONS: dict[type, str] = {GenerateConfig: "generate", ExtractConfig: "extract", TrainConfig: "train"}


def load_section(yaml_path: str | Path, section: str) -> dict[str, Any]:
    """Read one section (`generate`, `extract` or `train`) of a pipeline file; a missing section is empty."""
    import yaml

    path = Path(yaml_path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise BadConfig(f"pipeline file not found: {path}") from None
    except IsADirectoryError:
        raise BadConfig(f"pipeline file {path} is a directory: give the YAML file itself (-c FILE)") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise BadConfig(f"pipeline file {path} is not valid YAML{where}") from None
    if not isinstance(doc, dict):
        raise BadConfig(
            f"pipeline file {path} must be a mapping with 'generate:', 'extract:' and/or 'train:' sections"
        )
    unknown = set(doc) - set(SECTIONS.values())
    if unknown:
        raise BadConfig(
            f"pipeline file {path}: unknown section(s) {sorted(unknown)}; expected 'generate', 'extract' and 'train'"
        )
    body = doc.get(section) or {}
    if not isinstance(body, dict):
        raise BadConfig(f"pipeline file {path}: section '{section}' must be a mapping")
    return body


def resolve(cls: type[C], yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> C:
    """Build a config: defaults < pipeline-file section < overrides (flags given, i.e. not None).

    Raises:
        BadConfig: unknown key (with the closest valid name), wrong type, or invalid value.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    if yaml_path is not None:
        section = SECTIONS[cls]
        for key, value in load_section(yaml_path, section).items():
            values[_check_key(str(key).replace("-", "_"), names, f"section '{section}' of {yaml_path}")] = (
                value
            )
    for key, value in (overrides or {}).items():
        if value is not None:
            values[_check_key(key, names, "flags")] = value
    hints = typing.get_type_hints(cls)
    coerced = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    return cls(**coerced)


def _check_key(key: str, names: list[str], where: str) -> str:
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BadConfig(f"unknown setting {key!r} in {where}{hint}")
    return key


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Accept YAML/flag values for a field type: comma strings for int lists, scalars for str lists."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is list:
        item = args[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if item is int else [value]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(name, v, item) for v in value]
    if origin is Literal:
        if value not in args:
            raise BadConfig(f"{name} must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    try:
        if hint is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise TypeError
            return value
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if hint is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise TypeError
            return str(value)
    except (TypeError, ValueError):
        raise BadConfig(f"{name} must be of type {getattr(hint, '__name__', hint)}; got {value!r}") from None
    return value


def to_dict(cfg: GenerateConfig | ExtractConfig | TrainConfig) -> dict[str, Any]:
    """The resolved config as a plain dict (written beside outputs, compared on resume)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def field_choices(cls: type, name: str) -> tuple[Any, ...]:
    """The allowed values of a `Literal[...]` field (also inside `X | None`); () for any other type."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def is_required(cls: type, name: str) -> bool:
    """True for a field the user must give (flag or pipeline file); its check is `_require` in `__post_init__`."""
    return bool({f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("required", False))


def describe_fields(cls: type) -> list[tuple[str, str, Any]]:
    """(name, help, default) of every field: the source of the CLI help and the pipeline-file docs."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        out.append((f.name, f.metadata.get("help", ""), default))
    return out
