"""Reply generation with transformers: our own decode loop with continuous batching (`hf_decode`).

The loop keeps up to `batch_size` requests running (on CUDA, by default as many as the free memory holds), refills
the slots of finished rows from the queue, and samples every request from its own seeded stream, so a reply depends
only on its prompt, its seed and the settings (not on the batch). Greedy replies are those of `model.generate`.
Models whose attention the loop does not reproduce (sliding-window layers, attention other than SDPA) run through
`model.generate` in left-padded batches instead, each batch under `torch.random.fork_rng` seeded from its
requests' seeds (its replies then depend on the batch composition, which is a pure function of the call). The
model's own generation_config (sampling defaults shipped with the checkpoint) is never used. Never writes files.
"""

from __future__ import annotations

import logging
import os

import torch

from peagle_pipeline.backends.generation import (
    GeneratedReply,
    GeneratorSettings,
    SamplingSettings,
    combine_seeds,
    split_reply,
)
from peagle_pipeline.backends.hf import resolve_device
from peagle_pipeline.backends.hf_decode import DecodeLimits, decode_all
from peagle_pipeline.backends.hf_slots import decode_attention

__all__ = ["HFGenerator", "generation_device", "auto_batch_size"]

log = logging.getLogger(__name__)

CPU_BATCH = 16  # requests decoded together on a CPU when batch_size is not set
MAX_AUTO_BATCH = 2048  # the most requests decoded together when the GPU's free memory sets the batch
MEMORY_FRACTION = (
    0.8  # of the free GPU memory, for the KV store and the sampling buffers (the rest: prefill etc.)
)
PREFILL_TOKENS = {"cpu": 2048, "cuda": 32768}  # prompt tokens per prefill forward (memory of the activations)
CUDA_GRAPHS_ENV = "PEAGLE_HF_CUDA_GRAPHS"  # 1: replay the decode step as CUDA graphs (not yet measured: off)
ATTENTION = "peagle_decode_sdpa"  # the name `decode_attention` is registered under in transformers


def generation_device(name: str) -> torch.device:
    """`resolve_device`, and one GPU per process: with several GPUs, `auto` or a bare `cuda` under torchrun
    (LOCAL_RANK) means the local rank's GPU."""
    device = resolve_device(name)
    local = os.environ.get("LOCAL_RANK")
    if device.type == "cuda" and device.index is None and local is not None and torch.cuda.device_count() > 1:
        device = torch.device("cuda", int(local) % torch.cuda.device_count())
    return device


def auto_batch_size(model: torch.nn.Module, device: torch.device, capacity: int, max_new: int) -> int:
    """Requests that fit the free memory of `device` (CUDA): a KV row of `capacity` positions and the sampling
    buffers each, within MEMORY_FRACTION of what is free, at most MAX_AUTO_BATCH."""
    cfg = model.config.get_text_config()  # type: ignore[operator,union-attr]
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    element = next(model.parameters()).element_size()
    vocab = model.get_output_embeddings().weight.shape[0]  # type: ignore[operator,union-attr]
    per_row = 2 * cfg.num_hidden_layers * kv_heads * head_dim * element * capacity + 40 * vocab + 16 * max_new
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached by this process
    return max(1, min(MAX_AUTO_BATCH, int(free * MEMORY_FRACTION) // per_row))


def _unsupported(model: torch.nn.Module) -> str | None:
    """Why the decode loop cannot run this model (then `model.generate` does), or None."""
    cfg = model.config.get_text_config()  # type: ignore[operator,union-attr]
    impl = model.config._attn_implementation  # type: ignore[union-attr]
    if impl not in ("sdpa", ATTENTION):
        return f"attention {impl!r} (the loop needs sdpa)"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return "layers other than full attention"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    return None


class HFGenerator:
    """The target in transformers, generating replies for token-id prompts.

    Raises:
        BadInput: unloadable model or unknown device.
    """

    def __init__(self, settings: GeneratorSettings) -> None:
        from transformers import AttentionInterface, GenerationConfig

        from peagle_pipeline.backends.hf import load_causal_lm

        self.device = generation_device(settings.device)
        self.batch_size = settings.batch_size
        dtype = torch.bfloat16 if settings.dtype == "bf16" else torch.float32
        model = load_causal_lm(settings.model, dtype)
        model.generation_config = (
            GenerationConfig()
        )  # no checkpoint defaults (top_k, temperature, ...) leak in
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' typed `to`
        self.plain_reason = _unsupported(self.model) if settings.decode_loop else "decode_loop off"
        if self.plain_reason is None:
            try:  # transformers' documented extension point; without it the loop still runs, on plain SDPA
                AttentionInterface.register(ATTENTION, decode_attention)
                self.model.set_attn_implementation(ATTENTION)
            except (ValueError, KeyError, AttributeError) as err:
                log.warning("grouped decode attention not set (%s); using sdpa", str(err).splitlines()[0])
        else:
            log.info("HF generation through model.generate: %s", self.plain_reason)

    def generate(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings
    ) -> list[GeneratedReply]:
        """One reply per prompt, in prompt order (see the module docstring for batching and seeding)."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt")
        if self.plain_reason is not None:
            return self._plain(prompts, seeds, sampling)
        capacity = max(len(p) for p in prompts) + sampling.max_new_tokens
        slots = self.slots(capacity, sampling.max_new_tokens)
        kind = "cuda" if self.device.type == "cuda" else "cpu"
        limits = DecodeLimits(
            slots=slots,
            prefill_tokens=PREFILL_TOKENS[kind],
            refill_at=max(1, slots // 8),
            cuda_graphs=os.environ.get(CUDA_GRAPHS_ENV) == "1",
        )
        return decode_all(self.model, prompts, seeds, sampling, limits, self.device)

    def slots(self, capacity: int, max_new: int) -> int:
        """Requests decoded together: batch_size when set, else from the free GPU memory (CUDA) or CPU_BATCH."""
        if self.batch_size is not None:
            return self.batch_size
        if self.device.type != "cuda":
            return CPU_BATCH
        return auto_batch_size(self.model, self.device, capacity, max_new)

    def _plain(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings
    ) -> list[GeneratedReply]:
        """`model.generate` in batches of the longest prompts first, each seeded from its requests' seeds."""
        size = self.batch_size or CPU_BATCH
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        replies: list[GeneratedReply | None] = [None] * len(prompts)
        for start in range(0, len(order), size):
            idx = order[start : start + size]
            batch = self._batch([prompts[i] for i in idx], combine_seeds([seeds[i] for i in idx]), sampling)
            for i, reply in zip(idx, batch, strict=True):
                replies[i] = reply
        return [r for r in replies if r is not None]

    def _batch(self, prompts: list[list[int]], seed: int, s: SamplingSettings) -> list[GeneratedReply]:
        B, T = len(prompts), max(len(p) for p in prompts)
        pad = s.stop_token_ids[0]
        input_ids = torch.full((B, T), pad, dtype=torch.long)  # [B, T], left padded
        mask = torch.zeros((B, T), dtype=torch.long)  # [B, T]
        for b, p in enumerate(prompts):
            input_ids[b, T - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, T - len(p) :] = 1
        kwargs: dict[str, object] = {
            "max_new_tokens": s.max_new_tokens,
            "eos_token_id": list(s.stop_token_ids),
            "pad_token_id": pad,
            "repetition_penalty": s.repetition_penalty,
            "do_sample": s.temperature > 0,
        }
        if s.temperature > 0:
            # top_k 0: transformers' default top-k 50 would truncate what vLLM samples from
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=0)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.inference_mode(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), **kwargs
            )  # [B, T + new]
        generated = out[:, T:].tolist()
        return [split_reply(g, s.stop_token_ids, s.max_new_tokens) for g in generated]

    def close(self) -> None:
        """Drop the model (frees its memory once nothing else holds it)."""
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
