"""Generation overhead: `peagle-pipeline generate` through vLLM vs a bare `LLM.generate` of the same prompts and
settings (goal >= 0.90x). Runs in the vLLM environment (.venv-vllm).

Prompts are the first-turn prompts of the first ShareGPT rows (as `generate --turns first` renders them, those over
--max-prompt-tokens left out); both sides use the same per-request seeds, so they should produce the same replies
(checked and reported). Order: bare, generate, bare (the two bare runs are averaged to cancel drift on a shared
machine); each run starts its own engine and only the generation is timed (the generate stage reports its time
without the engine start-up). Throughput = generated tokens / seconds. With --also-hf the HF backend of the stage
is measured on the same prompts too (not part of the ratio).

    .venv-vllm/bin/python -m bench.bench_generate --out bench/results/generate.json [--prompts 64 --max-new-tokens 256]

--backend hf (no vLLM needed; `bench/generate_hf.py`): the stage with the HF backend against plain `model.generate`
of the same prompts, on --device (cpu, cuda), in one run:

    python -m bench.bench_generate --backend hf --device cuda --prompts 4096 --plain-batch 1024 --out gen-hf.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import DEMO_DATA, DEMO_MODEL, write_result
from peagle_pipeline.config import GenerateConfig
from peagle_pipeline.stages.generate import stage


def first_turn_prompts(cfg: GenerateConfig, n: int) -> tuple[list[tuple[int, list[int]]], int, list[int]]:
    """(row index, prompt ids) of the first n usable rows, the number of rows they span, and the stop ids."""
    from transformers import AutoTokenizer

    from peagle_pipeline.data.chat import ChatRenderer, RejectRow
    from peagle_pipeline.data.dialogue import DialogueBuilder
    from peagle_pipeline.data.formats import iter_rows
    from peagle_pipeline.data.records import Conversation

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(cfg.model))
    stops = stage.resolve_stop_ids(cfg.model, renderer)
    builder = DialogueBuilder(renderer, "first", stops)
    prompts: list[tuple[int, list[int]]] = []
    for index, row in enumerate(iter_rows(cfg.data)):
        if len(prompts) == n:
            return prompts, index, stops
        if not isinstance(row, Conversation):
            continue
        try:
            d = builder.start(row, index)
        except RejectRow:
            continue
        if len(d.input_ids) <= cfg.max_prompt_tokens:
            prompts.append((index, d.input_ids))
    return prompts, index + 1, stops


def bare_run(
    cfg: GenerateConfig, prompts: list[tuple[int, list[int]]], stops: list[int]
) -> tuple[float, list]:
    """Seconds of one bare `LLM.generate` call over all prompts (engine start-up excluded), and the outputs."""
    from peagle_pipeline.backends.generation import SamplingSettings, request_seed
    from peagle_pipeline.backends.vllm import EngineSettings, build_llm, shutdown_llm
    from peagle_pipeline.backends.vllm_generate import _seeded_sampling_workaround, sampling_params
    from peagle_pipeline.hardware import resolve_compute_dtype

    llm = build_llm(
        EngineSettings(
            model=cfg.model,
            dtype=resolve_compute_dtype(cfg.compute_dtype, stage._device_type("auto", "vllm")),  # type: ignore[arg-type]
            max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens,
        ),
        in_process_on_cpu=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        **_seeded_sampling_workaround(
            cfg.max_prompt_tokens + cfg.max_new_tokens
        ),  # the same engine as generate's
    )
    s = SamplingSettings(cfg.temperature, cfg.top_p, cfg.repetition_penalty, cfg.max_new_tokens, tuple(stops))
    params = [sampling_params(s, request_seed(cfg.seed, i, 0, 0)) for i, _ in prompts]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for _, p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    shutdown_llm(llm)
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def stage_run(cfg: GenerateConfig) -> tuple[stage.GenerateSummary, dict[int, list[int]]]:
    """The generate stage; returns its summary and the first reply's ids per source row."""
    summary = stage.run(cfg)
    replies: dict[int, list[int]] = {}
    for line in (Path(cfg.output) / "rows-rank00000-of-00001.jsonl").read_text().splitlines():
        row = json.loads(line)
        mask = row["loss_mask"]
        start = mask.index(1)
        replies[row["source_row"]] = row["input_ids"][start:]
    return summary, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--also-hf", action="store_true", help="also time the stage with the HF backend")
    ap.add_argument(
        "--backend", choices=["vllm", "hf"], default="vllm", help="hf: the HF stage vs model.generate"
    )
    ap.add_argument("--device", default="auto", help="hf: cpu, cuda, cuda:N or auto")
    ap.add_argument("--batch-size", type=int, default=None, help="hf: the stage's batch (default: its own)")
    ap.add_argument("--plain-batch", type=int, default=16, help="hf: model.generate's batch")
    ap.add_argument(
        "--plain-cache", choices=["dynamic", "static"], default="dynamic", help="hf: its KV cache"
    )
    ap.add_argument(
        "--plain-once", action="store_true", help="hf: one plain run (after the stage: skip the second)"
    )
    ap.add_argument(
        "--cuda-graphs", action="store_true", help="hf: the stage again with CUDA-graph decode steps"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    try:
        base = dict(
            model=args.model,
            data=[args.data],
            turns="first",
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
        )
        probe = GenerateConfig(**base, output=str(work / "probe"))
        prompts, rows, stops = first_turn_prompts(probe, args.prompts)
        if args.backend == "hf":
            from bench.generate_hf import run_hf

            write_result(args.out, run_hf(args, base, prompts, rows, stops, work))
            return
        cfg = GenerateConfig(
            **base, output=str(work / "vllm"), backend="vllm", max_samples=rows, chunk_size=rows
        )
        bare1, bare_out = bare_run(cfg, prompts, stops)
        summary, stage_out = stage_run(cfg)
        bare2, _ = bare_run(cfg, prompts, stops)
        bare_tokens = sum(len(x) for x in bare_out)
        bare_rate = bare_tokens / ((bare1 + bare2) / 2)
        stage_rate = summary.tokens_per_s
        same = sum(stage_out.get(i) == out for (i, _), out in zip(prompts, bare_out, strict=True))
        result = {
            "model": args.model,
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "bare_generated_tokens": bare_tokens,
            "stage_generated_tokens": summary.new_tokens,
            "bare_seconds": [round(bare1, 2), round(bare2, 2)],
            "stage_seconds": round(summary.elapsed_s - summary.engine_s, 2),
            "bare_tokens_per_s": bare_rate,
            "generate_tokens_per_s": stage_rate,
            "ratio": stage_rate / bare_rate,
            "identical_replies": same,
            "goal_ratio_min": 0.90,
        }
        if args.also_hf:
            hf_cfg = GenerateConfig(
                **base, output=str(work / "hf"), backend="hf", max_samples=rows, chunk_size=rows
            )
            hf, _ = stage_run(hf_cfg)
            result["hf_generate_tokens_per_s"] = hf.tokens_per_s
            result["hf_generated_tokens"] = hf.new_tokens
        print(
            f"\n{len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, temperature {args.temperature}\n"
        )
        print("| path | generated tokens | tokens/s | vs bare |")
        print("|---|---:|---:|---:|")
        print(f"| bare LLM.generate (mean of 2) | {bare_tokens} | {bare_rate:.1f} | 1.00 |")
        print(f"| generate (vllm) | {summary.new_tokens} | {stage_rate:.1f} | {result['ratio']:.3f} |")
        if args.also_hf:
            hf_rate = result["hf_generate_tokens_per_s"]
            print(
                f"| generate (hf) | {result['hf_generated_tokens']} | {hf_rate:.1f} | {hf_rate / bare_rate:.3f} |"
            )
        print(f"\nreplies identical to the bare run's: {same}/{len(prompts)}")
        write_result(args.out, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
