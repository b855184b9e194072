"""`bench_generate.py --backend hf`: the generate stage with the HF backend against plain `model.generate` of the
same first-turn prompts, in one process on one device (CPU, or a GPU machine without vLLM).

Plain side: the target loaded as the stage loads it, the prompts sorted longest first in left-padded batches of
--plain-batch, `model.generate` with the stage's sampling (T, top-p, top-k off, stop ids) and transformers' own
cache (--plain-cache dynamic, or static: transformers compiles the decode step then). Stage side: `generate` with
the same prompts in one chunk (its own timer leaves out loading the model). On CUDA one small untimed plain batch
warms the GPU first. Order: plain, stage, plain (the two plain runs averaged). At T = 0 the replies are compared.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from peagle_pipeline.backends.hf_generate import CUDA_GRAPHS_ENV
from peagle_pipeline.config import GenerateConfig
from peagle_pipeline.stages.generate import stage


def plain_generate(
    model: Any, prompts: list[list[int]], cfg: GenerateConfig, stops: list[int], batch: int, cache: str
) -> tuple[float, dict[int, list[int]]]:
    """Seconds of `model.generate` over all prompts and the replies (cut after the first stop id) by prompt index."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    kwargs: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "eos_token_id": stops,
        "pad_token_id": stops[0],
        "do_sample": cfg.temperature > 0,
    }
    if cfg.temperature > 0:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    replies: dict[int, list[int]] = {}
    _sync(device)
    t = time.perf_counter()
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        T = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), T), stops[0], dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, T - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[b, T - len(prompts[i]) :] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        for i, row in zip(idx, out[:, T:].tolist(), strict=True):
            cut = next((k + 1 for k, tok in enumerate(row) if tok in stops), len(row))
            replies[i] = row[:cut]
    _sync(device)
    return time.perf_counter() - t, replies


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_plain(cfg: GenerateConfig, device: str) -> Any:
    """The target as the stage's HF backend loads it (dtype, device), for plain `model.generate`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from peagle_pipeline.backends.hf_generate import generation_device
    from peagle_pipeline.hardware import resolve_compute_dtype

    dev = generation_device(device)
    dtype = resolve_compute_dtype(cfg.compute_dtype, dev.type)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32
    )
    model.generation_config = GenerationConfig()
    return model.to(dev).eval()  # type: ignore[arg-type]  # transformers types `to` narrowly


def stage_replies(output: str) -> dict[int, list[int]]:
    """The first generated reply per source row of a finished `generate` output."""
    replies: dict[int, list[int]] = {}
    for line in (Path(output) / "rows-rank00000-of-00001.jsonl").read_text().splitlines():
        row = json.loads(line)
        start = row["loss_mask"].index(1)
        replies[row["source_row"]] = row["input_ids"][start:]
    return replies


def run_hf(
    args: Any,
    base: dict[str, Any],
    prompts: list[tuple[int, list[int]]],
    rows: int,
    stops: list[int],
    work: Path,
) -> dict[str, Any]:
    """Plain, stage, plain on the same prompts; returns the result (see the module docstring)."""
    cfg = GenerateConfig(
        **base,
        output=str(work / "hf"),
        backend="hf",
        device=args.device,
        batch_size=args.batch_size,
        max_samples=rows,
        chunk_size=rows,
    )
    ids = [p for _, p in prompts]
    model = load_plain(cfg, args.device)
    device = next(model.parameters()).device
    if device.type == "cuda":
        plain_generate(model, ids[: min(len(ids), 64)], cfg, stops, 64, args.plain_cache)  # warm-up, untimed
    plain1, plain_out = plain_generate(model, ids, cfg, stops, args.plain_batch, args.plain_cache)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the plain run's cached blocks back to the GPU before the stage sizes its batch
    summary = stage.run(cfg)
    plain2, _ = (
        (plain1, None)
        if args.plain_once
        else plain_generate(model, ids, cfg, stops, args.plain_batch, args.plain_cache)
    )
    got = stage_replies(cfg.output)
    plain_tokens = sum(len(r) for r in plain_out.values())
    plain_rate = plain_tokens / ((plain1 + plain2) / 2)
    same = sum(got.get(row) == plain_out[k] for k, (row, _) in enumerate(prompts))
    result = {
        "backend": "hf",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "model": args.model,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": cfg.top_p,
        "stage_batch_size": args.batch_size if args.batch_size else "auto",
        "plain_batch_size": args.plain_batch,
        "plain_cache": args.plain_cache,
        "plain_generated_tokens": plain_tokens,
        "stage_generated_tokens": summary.new_tokens,
        "plain_seconds": [round(plain1, 2), round(plain2, 2)],
        "stage_seconds": round(summary.elapsed_s - summary.engine_s, 2),
        "stage_load_seconds": round(summary.engine_s, 2),
        "plain_tokens_per_s": plain_rate,
        "generate_tokens_per_s": summary.tokens_per_s,
        "ratio": summary.tokens_per_s / plain_rate,
        "identical_replies": same,
        "goal_tokens_per_s": 40_000 if device.type == "cuda" else None,
    }
    if args.cuda_graphs:
        result.update(graphs_run(cfg, got, work))
    print(
        f"\n{len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, T {args.temperature}, {result['device']}\n"
    )
    print("| path | generated tokens | tokens/s | vs plain |")
    print("|---|---:|---:|---:|")
    print(
        f"| plain model.generate (batch {args.plain_batch}, {args.plain_cache} cache) | {plain_tokens} | {plain_rate:.1f} | 1.00 |"
    )
    print(
        f"| generate --backend hf (batch {result['stage_batch_size']}) | {summary.new_tokens} | {summary.tokens_per_s:.1f} | {result['ratio']:.3f} |"
    )
    print(
        f"\nreplies identical to plain model.generate's: {same}/{len(prompts)}"
        + (" (sampled: not expected)" if args.temperature > 0 else "")
    )
    if args.cuda_graphs:
        print(
            f"with {CUDA_GRAPHS_ENV}=1: {result['graphs_tokens_per_s']:.1f} tokens/s, "
            f"{result['graphs_identical_replies']}/{len(prompts)} replies identical to the eager stage's"
        )
    return result


def graphs_run(cfg: GenerateConfig, eager: dict[int, list[int]], work: Path) -> dict[str, Any]:
    """The stage again with the decode step replayed as CUDA graphs: its rate and how many replies equal the eager
    run's (the same kernels and the same random streams: all of them, when the graphs are right)."""
    import dataclasses
    import os

    os.environ[CUDA_GRAPHS_ENV] = "1"
    try:
        graphs_cfg = dataclasses.replace(cfg, output=str(work / "hf-graphs"))
        summary = stage.run(graphs_cfg)
    finally:
        del os.environ[CUDA_GRAPHS_ENV]
    got = stage_replies(graphs_cfg.output)
    return {
        "graphs_tokens_per_s": summary.tokens_per_s,
        "graphs_generated_tokens": summary.new_tokens,
        "graphs_seconds": round(summary.elapsed_s - summary.engine_s, 2),
        "graphs_identical_replies": sum(got.get(k) == v for k, v in eager.items()),
    }
