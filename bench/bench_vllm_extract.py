"""Extraction through vLLM vs a bare vLLM prefill of the same prompts (goal >= 0.85x).

Both sides get the same batches, planned exactly as `peagle-pipeline extract --backend vllm` plans them:
  - extraction: what `extract` runs, `VLLMBackend` (hidden states through our KV connector, `prompt_logprobs=k`)
    behind `stages.extract.batch_pipeline.BatchPipeline`, into a real `CacheWriter` (zstd shards, checksums, commits);
  - bare: a plain vLLM engine with the same engine settings (model, dtype, context, no prefix caching), one
    `LLM.generate` per batch with max_tokens 1, no log-probs, no hidden states;
  - log-probs: the bare engine asked only for what vLLM must compute for the targets (`prompt_logprobs=k`: the
    lm_head and a full-vocabulary log-softmax on every row, where the bare prefill takes the last row's logits
    only). bare / log-probs is the part of the gap that is vLLM's own; log-probs / extraction is ours (hidden
    states through the connector, reading them back, the cache write).
Both engines run side by side; the batches are timed in groups of --group, each group by every side, rotating
which goes first (drift on a shared machine). Both engines run in processes of their own
(`VLLM_ENABLE_V1_MULTIPROCESSING=1` unless set), as on a GPU: two in-process engines cannot share one process when
one has a KV connector (vLLM keeps the connector process-wide, and the second engine's start hands its cache to the
first's connector). `extract` itself runs its one engine in-process on a CPU (48 samples in 75 s against 79 with
engine processes, 2026-11-30), so on a CPU this measures it slightly low. On a CPU both engines get the same cores:
`VLLM_CPU_NUM_OF_RESERVED_CPU=0` (unless set) keeps vLLM's CPU backend from holding one core per worker back for its
scheduler and one more for a KV connector (never all of them: on 2 cores the extraction engine then computed on
both while a bare engine got one, 224 tokens/s against 370-423, making extraction look 1.17-1.37x faster than a bare
prefill); on a GPU it changes nothing. Engine start and one warm-up batch are excluded. Runs in the vLLM env
(vllm-cpu here; CUDA vLLM where it is installed). Prints a Markdown table; writes JSON to --out.

    .venv-vllm/bin/python -m bench.bench_vllm_extract --out bench/results/vllm_extract.json [--samples 24]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DEMO_DATA, DEMO_MODEL, write_result
from peagle_pipeline.cache.writer import CacheWriter
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.data.records import rank_rows
from peagle_pipeline.stages.extract.batch_pipeline import BatchPipeline
from peagle_pipeline.stages.extract.batch_plan import PlannedSample, plan_batches, render_rows
from peagle_pipeline.stages.extract.cache_output import build_meta, prepare_output
from peagle_pipeline.stages.extract.settings import backend_settings, settle, target_device


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--group", type=int, default=2, help="consecutive batches timed together per side")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def plan(cfg: ExtractConfig) -> list[list[PlannedSample]]:
    """The batches `extract` forms for these settings (rejects left out)."""
    from transformers import AutoTokenizer

    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.data.formats import iter_rows

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(cfg.model))
    rows = rank_rows(iter_rows(cfg.data), 0, 1, cfg.max_samples)
    items = plan_batches(render_rows(rows, renderer, cfg.max_length, cfg.overlong), cfg.batch_tokens)
    return [b for b in items if isinstance(b, list)]


def main() -> None:
    args = parse()
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the same cores for both engines (see above)
    # two engines, one with a KV connector, need processes of their own (see above)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    from vllm import SamplingParams

    from peagle_pipeline.backends.vllm import EngineSettings, VLLMBackend, build_llm, shutdown_llm
    from peagle_pipeline.model_dir import read_target_info, text_config

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-extract-"))
    ours = bare = None
    try:
        cfg = ExtractConfig(
            model=args.model,
            data=[args.data],
            output=str(work / "cache"),
            backend="vllm",
            max_samples=args.samples,
            max_length=args.max_length,
            batch_tokens=args.batch_tokens,
        )
        info = read_target_info(cfg.model)
        settled = settle(cfg, info, None, target_device(cfg), (0, 1))
        layer_ids = list(settled.layer_ids)
        meta = build_meta(settled)
        batches = plan(cfg)
        settings = backend_settings(cfg)
        ours = VLLMBackend(settings, layer_ids)
        max_pos = text_config(info.config).get("max_position_embeddings") or cfg.max_length + 1
        bare = build_llm(
            EngineSettings(
                model=cfg.model,
                dtype=settings.compute_dtype,
                max_model_len=min(cfg.max_length + 1, max_pos),
                max_num_batched_tokens=cfg.max_num_batched_tokens,
            ),
            skip_tokenizer_init=True,
            max_logprobs=settings.topk,
        )
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        k = settings.topk
        with_logprobs = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=k, logprobs=k, flat_logprobs=True
        )

        def prefill(batch: list[PlannedSample], sampling: SamplingParams = params) -> None:
            bare.generate([{"prompt_token_ids": s.input_ids} for s in batch], sampling, use_tqdm=False)

        ours.forward([s.input_ids for s in batches[0][:1]])  # warm-up
        prefill(batches[0][:1])
        writer = CacheWriter(prepare_output(cfg, meta), meta, 0, 1).open()
        ahead = BatchPipeline(writer, lambda n: None)
        seconds = {"bare": 0.0, "logprobs": 0.0, "extract": 0.0}

        def run_extract(group: list[list[PlannedSample]]) -> None:
            for batch in group:
                ahead.submit(ours, batch)
            ahead.drain()

        def run_bare(group: list[list[PlannedSample]]) -> None:
            for batch in group:
                prefill(batch)

        def run_logprobs(group: list[list[PlannedSample]]) -> None:
            for batch in group:
                prefill(batch, with_logprobs)

        sides = [("bare", run_bare), ("logprobs", run_logprobs), ("extract", run_extract)]
        groups = [batches[i : i + args.group] for i in range(0, len(batches), args.group)]
        for i, group in enumerate(groups):
            for name, fn in sides[i % 3 :] + sides[: i % 3]:
                t = time.perf_counter()
                fn(group)
                seconds[name] += time.perf_counter() - t
        t = time.perf_counter()
        writer.close()
        seconds["extract"] += time.perf_counter() - t
        result = summary(args, batches, seconds, settings.compute_dtype, k)
        lengths = [len(s.input_ids) for b in batches for s in b]
        mean_context = sum(n * n for n in lengths) / (2 * sum(lengths))  # keys a token attends to, on average
        result["matmul_ceiling"] = matmul_ceiling(text_config(info.config), mean_context)
    finally:
        if ours is not None:
            ours.close()
        shutdown_llm(bare)
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{result['samples']} samples in {result['batches']} batches, {result['tokens']} tokens, "
        f"vLLM {result['vllm']} ({result['compute_dtype']})\n"
    )
    print("| path | tokens/s | vs bare prefill |\n|---|---:|---:|")
    print(f"| bare vLLM prefill (max_tokens 1, no log-probs) | {result['bare_tokens_per_s']:.0f} | 1.00 |")
    print(
        f"| the same with `prompt_logprobs={result['topk']}` (vLLM's part) | "
        f"{result['logprobs_tokens_per_s']:.0f} | {result['logprobs_ratio']:.3f} |"
    )
    print(
        f"| extraction (hidden states + top-k + cache write) | {result['extract_tokens_per_s']:.0f} | "
        f"{result['ratio']:.3f} |"
    )
    print(f"\nextraction vs the log-probs prefill (our part): {result['extract_vs_logprobs']:.3f}")
    if result["matmul_ceiling"] is not None:
        print(
            f"the ceiling for this target (lm_head on every row, matmul work only): {result['matmul_ceiling']:.3f}"
        )
    write_result(args.out, result)


def summary(
    args: argparse.Namespace, batches: list[list[Any]], seconds: dict[str, float], dtype: str, topk: int
) -> dict[str, Any]:
    import importlib.metadata

    import torch

    tokens = sum(len(s.input_ids) for b in batches for s in b)
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
    return {
        "model": args.model,
        "vllm": version,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "compute_dtype": dtype,
        "topk": topk,
        "samples": sum(len(b) for b in batches),
        "batches": len(batches),
        "group": args.group,
        "tokens": tokens,
        "bare_tokens_per_s": tokens / seconds["bare"],
        "extract_tokens_per_s": tokens / seconds["extract"],
        "logprobs_tokens_per_s": tokens / seconds["logprobs"],
        "ratio": seconds["bare"] / seconds["extract"],
        "logprobs_ratio": seconds["bare"] / seconds["logprobs"],
        "extract_vs_logprobs": seconds["logprobs"] / seconds["extract"],
        "goal_ratio_min": 0.85,
        "load_avg": os.getloadavg()[0],
        "cpu_reserved_cores": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu_name(),
    }


def matmul_ceiling(config: dict[str, Any], mean_context: float) -> float | None:
    """The best `ratio` any exact top-k extraction can reach: the bare prefill's matmul work per token over that
    plus the lm_head on every row (its log-softmax and top-k taken as free), for a dense decoder; None for a
    config this does not model (mixture of experts, no intermediate_size).

    Per token: q/k/v/o projections, the gated MLP (3 x hidden x intermediate) and attention over `mean_context`
    keys, in each layer; the lm_head is hidden x vocab. E.g. SmolLM2-135M (30 layers, hidden 576, 9 / 3 heads of
    64, intermediate 1536, vocab 49152) at 250 keys: 115M vs 28M multiply-adds, ceiling 0.80; Llama-3.1-8B:
    0.93.
    """
    moe = ("num_experts", "num_local_experts", "n_routed_experts")
    if any(config.get(key) for key in moe) or not config.get("intermediate_size"):
        return None
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    projections = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * int(config["intermediate_size"])
    attention = 2 * heads * head_dim * mean_context
    body = int(config["num_hidden_layers"]) * (projections + mlp + attention)
    return body / (body + hidden * int(config["vocab_size"]))


def _cpu_name() -> str:
    """The CPU's model name (Linux), or the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
