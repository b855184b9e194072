"""Time one side of bench_vllm_extract alone, one engine in this process: bare | logprobs | extract.

.venv-vllm/bin/python bench/results/vllm-extract-amd-avx2-2026-11-29/one_engine.py bare 24   (NOASYNC=1: bare without async scheduling)
"""

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.bench_vllm_extract import plan
from bench.common import DEMO_DATA, DEMO_MODEL
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.model_dir import read_target_info
from peagle_pipeline.stages.extract.settings import backend_settings, resolve_layers


def main():
    side = sys.argv[1]
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    work = Path(tempfile.mkdtemp())
    cfg = ExtractConfig(
        model=str(DEMO_MODEL),
        data=[str(DEMO_DATA)],
        output=str(work / "c"),
        backend="vllm",
        max_samples=samples,
        max_length=512,
        batch_tokens=4096,
    )
    info = read_target_info(cfg.model)
    layer_ids = resolve_layers(cfg, info.num_hidden_layers)
    batches = plan(cfg)
    settings = backend_settings(cfg)
    from vllm import SamplingParams

    from peagle_pipeline.backends.vllm import EngineSettings, VLLMBackend, build_llm, shutdown_llm

    k = settings.topk
    if side == "extract":
        ours = VLLMBackend(settings, layer_ids)

        def run(b):
            return ours.forward([s.input_ids for s in b])
    else:
        llm = build_llm(
            EngineSettings(
                model=cfg.model,
                dtype=settings.compute_dtype,
                max_model_len=513,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
            ),
            skip_tokenizer_init=True,
            max_logprobs=k,
            **({"async_scheduling": False} if os.environ.get("NOASYNC") else {}),
        )
        p = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        if side == "logprobs":
            p = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                prompt_logprobs=k,
                logprobs=k,
                flat_logprobs=True,
            )

        def run(b):
            return llm.generate([{"prompt_token_ids": s.input_ids} for s in b], p, use_tqdm=False)

    run(batches[0][:1])
    if len(sys.argv) > 3:
        return
    tokens = sum(len(s.input_ids) for b in batches for s in b)
    for rep in range(2):
        t = time.perf_counter()
        for b in batches:
            t1 = time.perf_counter()
            run(b)
            print(
                f"  batch {len(b)} samples {sum(len(s.input_ids) for s in b)} tok {time.perf_counter() - t1:.2f}s",
                flush=True,
            )
        dt = time.perf_counter() - t
        print(f"{side} rep{rep}: {tokens} tokens {dt:.2f} s {tokens / dt:.0f} tok/s", flush=True)
    if side == "extract":
        ours.close()
    else:
        shutdown_llm(llm)


if __name__ == "__main__":
    main()
