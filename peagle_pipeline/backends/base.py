"""The whole contract between the extraction runner and a target runtime (HF transformers or vLLM).

The runner hands a backend a batch of token-id lists and gets per-sample outputs in the cache's
conventions: unshifted rows, vLLM layer ids, true top-k log-probs over the full vocabulary.
The runner never branches on the backend name; `registry.get_backend` picks the implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from peagle_pipeline.target_info import TargetInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "BackendSettings",
    "SampleOutputs",
    "TargetBackend",
    "submit",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendSettings:
    """A target backend's own settings; the extract stage builds them from its section (`backend_settings`),
    where every default is defined."""

    model: str
    """Local HF model directory (config.json + safetensors + tokenizer)."""
    compute_dtype: Literal["bf16", "fp32"]
    """The forward's dtype, resolved (never auto)."""
    topk: int
    """Top log-probabilities kept per token."""
    last_hidden: bool
    """Also return the pre-norm last hidden state (layer id L)."""
    device: str
    """hf: auto, cpu, cuda, cuda:N."""
    topk_chunk: int
    """hf: tokens per chunk of the log-softmax/top-k computation."""
    max_length: int
    """vllm: the longest sample (the engine's context is one more)."""
    tensor_parallel_size: int
    """vllm: tensor parallel size."""
    gpu_memory_utilization: float
    """vllm: GPU memory fraction."""
    max_num_batched_tokens: int | None
    """vllm: scheduler token budget per step (None: vLLM's default)."""


@dataclass
class SampleOutputs:
    """One sample's target outputs, row t describing position t (unshifted).

    Attributes:
        aux_hidden: [T, n_aux, H] residual streams entering the selected layers (ascending ids), bf16 or fp32.
        topk_ids: [T, k] int64 ids of the top-k next-token candidates at each position, descending log-prob.
        topk_logprobs: [T, k] float32 true log-probs (log-softmax over the full target vocabulary).
        last_hidden: [T, H] pre-final-norm output of the last layer (layer id L), or None if not asked.
    """

    aux_hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    last_hidden: torch.Tensor | None = None


class TargetBackend(Protocol):
    """A target runtime. `forward` returns one SampleOutputs per input, in input order."""

    info: TargetInfo

    def forward(self, batch: list[list[int]]) -> list[SampleOutputs]: ...

    def close(self) -> None: ...


def submit(backend: TargetBackend, batch: list[list[int]]) -> Callable[[], list[SampleOutputs]]:
    """Start `batch` and return the call that gives its outputs (`forward`'s). A backend that can run ahead
    (`submit`, as HF on CUDA: the forward is queued on the device) returns before the device is done, so the runner
    writes batch i while batch i+1 computes; any other backend computes now."""
    start = getattr(backend, "submit", None)
    if start is not None:
        return start(batch)
    outputs = backend.forward(batch)
    return lambda: outputs
