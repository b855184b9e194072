"""Reply generation with transformers: batched `model.generate` with a KV cache, left padding and a mask.

Prompts are sorted by length (longest first) and cut into batches of `batch_size`, so padding stays small and
the batches are a pure function of the call. Sampling draws from the global torch RNG inside `generate`, so each
batch runs under `torch.random.fork_rng` seeded from its requests' seeds: the caller's RNG state is untouched and
the same call gives the same replies. The model's own generation_config (sampling defaults shipped with the
checkpoint) is replaced by explicit settings. Never writes files.
"""

from __future__ import annotations

import logging

import torch

from peagle_pipeline.backends.generation import (
    GeneratedReply,
    GeneratorSettings,
    SamplingSettings,
    combine_seeds,
    split_reply,
)
from peagle_pipeline.backends.hf import resolve_device
from peagle_pipeline.errors import BadInput

__all__ = ["HFGenerator"]

log = logging.getLogger(__name__)


class HFGenerator:
    """The target in transformers, generating replies for token-id prompts.

    Raises:
        BadInput: unloadable model or unknown device.
    """

    def __init__(self, settings: GeneratorSettings) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.device = resolve_device(settings.device)
        self.batch_size = settings.batch_size
        dtype = torch.bfloat16 if settings.dtype == "bf16" else torch.float32
        try:
            model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=dtype)
        except (OSError, ValueError) as err:
            raise BadInput(f"cannot load target model {settings.model}: {str(err).splitlines()[0]}") from None
        model.generation_config = (
            GenerationConfig()
        )  # no checkpoint defaults (top_k, temperature, ...) leak in
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' typed `to`

    def generate(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings
    ) -> list[GeneratedReply]:
        """One reply per prompt, in prompt order (see the module docstring for batching and seeding)."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        replies: list[GeneratedReply | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            batch = self._batch([prompts[i] for i in idx], combine_seeds([seeds[i] for i in idx]), sampling)
            for i, reply in zip(idx, batch, strict=True):
                replies[i] = reply
        return [r for r in replies if r is not None]

    def _batch(self, prompts: list[list[int]], seed: int, s: SamplingSettings) -> list[GeneratedReply]:
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt")
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
