"""Extraction overhead: HF-backend extraction tokens/s vs the bare HF forward over the same batches (goal >= 0.90x).

Both sides get the same padded batches (planned exactly as `peagle-pipeline extract` plans them):
  - bare: `HFBackend.bare_forward` = plain `model(input_ids)` (logits, no hooks, no top-k), one batch after the
    other without waiting for the device in between;
  - extraction: what `extract` runs, `stages.extract.batch_pipeline.BatchPipeline`: batch i+1 is submitted
    (hooks, chunked log-softmax/top-k, non-blocking copies to pinned memory) before batch i is converted to the
    stored dtypes and added to a real `CacheWriter` (zstd shards, checksums, commits).
The batches are timed in groups of --group consecutive batches, each group run by both sides, alternating which
side goes first to cancel drift on a shared machine; a group ends with the device synchronised (and the
extraction pipeline drained). --rounds passes over all the batches (each writing a fresh cache) are summed, and
each round's ratio is reported: one pass of `make bench`'s 6 batches read 0.89x to 0.98x on one host within an
hour. Goal: ratio >= 0.90.
`--size 8b` extracts from a randomly initialised Llama-3.1-8B-sized target instead (H 4096, 32 / 8 heads,
V 128256; `--layers` of them) with this repository's tiny test tokenizer and generated conversations (no download:
runs on the GPU machines); the default is the demo SmolLM2 model and ShareGPT data.
Prints a Markdown table; writes JSON to --out.

    python -m bench.bench_extract --out bench/results/extract.json [--model DIR --data FILE --samples 24]
    python -m bench.bench_extract --size 8b --layers 8 --device cuda --samples 64 --max-length 2048 \
        --batch-tokens 16384 --out OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DEMO_DATA, DEMO_MODEL, write_result
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.writer import CacheWriter
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.data.records import rank_rows
from peagle_pipeline.stages.extract.batch_pipeline import BatchPipeline
from peagle_pipeline.stages.extract.batch_plan import plan_batches, render_rows
from peagle_pipeline.stages.extract.cache_output import build_meta, prepare_output
from peagle_pipeline.stages.extract.settings import backend_settings, settle, target_device

LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}


def random_8b_target(out_dir: Path, layers: int, device: str) -> Path:
    """A randomly initialised Llama-3.1-8B-sized target (bf16, `layers` decoder layers) with the tiny test
    tokenizer (ids < 400 of its 128256); initialised on `device` (an 8B init on a CPU takes minutes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.tiny import build_tokenizer

    tok = build_tokenizer(out_dir)
    config = LlamaConfig(
        **LLAMA_8B,
        num_hidden_layers=layers,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir))
    del model
    return out_dir


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--size", choices=["demo", "8b"], default="demo", help="8b: a random 8B-sized target")
    ap.add_argument(
        "--layers",
        type=int,
        default=32,
        help="decoder layers of the --size 8b target (>= 4: the default aux ids are [2, L//2, L-3])",
    )
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--group", type=int, default=4, help="consecutive batches timed together per side")
    ap.add_argument("--rounds", type=int, default=1, help="passes over all the batches, summed")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = parse()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    try:
        if args.size == "8b":
            from bench.tiny import write_conversations

            args.model = str(random_8b_target(work / "target", args.layers, args.device))
            args.data = str(write_conversations(work / "conv.jsonl", args.samples, max_reply_words=2000))
        result = measure(args, work)
        report(result)
        write_result(args.out, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Time both sides over the planned batches (see the module docstring); the result's figures."""
    import torch
    from transformers import AutoTokenizer

    from peagle_pipeline.backends.registry import get_backend
    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.data.formats import iter_rows
    from peagle_pipeline.model_dir import read_target_info

    cfg = ExtractConfig(
        model=args.model,
        data=[args.data],
        output=str(work / "cache"),
        max_samples=args.samples,
        max_length=args.max_length,
        batch_tokens=args.batch_tokens,
        device=args.device,
    )
    info = read_target_info(cfg.model)
    settled = settle(cfg, info, None, target_device(cfg), (0, 1))
    layer_ids = list(settled.layer_ids)
    meta = build_meta(settled)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(cfg.model))
    rows = rank_rows(iter_rows(cfg.data), 0, 1, cfg.max_samples)
    plan = plan_batches(render_rows(rows, renderer, cfg.max_length, cfg.overlong), cfg.batch_tokens)
    batches = [b for b in plan if isinstance(b, list)]
    backend = get_backend(cfg.backend, backend_settings(cfg), layer_ids)
    device = backend.device  # type: ignore[attr-defined]  # HFBackend

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    backend.forward([s.input_ids for s in batches[0][:1]])  # warm-up (allocator, kernels)
    backend.bare_forward([s.input_ids for s in batches[0][:1]])
    sync()
    groups = [batches[i : i + args.group] for i in range(0, len(batches), args.group)]
    rounds = []
    for r in range(args.rounds):
        root = prepare_output(dataclasses.replace(cfg, output=str(work / f"cache-{r}")), meta)
        rounds.append(time_round(backend, root, meta, groups, r, sync))
    backend.close()
    seconds = {side: sum(s[side] for s in rounds) for side in ("bare", "extract")}
    ids = [s.input_ids for b in batches for s in b]
    tokens = sum(len(x) for x in ids)
    store = root / layout.STORES_DIR / layout.store_name(0, 1)
    return {
        "model": args.model if args.size == "demo" else f"random Llama-3.1-8B-sized, {args.layers} layers",
        "size": args.size,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "compute_dtype": meta.compute_dtype,
        "samples": len(ids),
        "batches": len(batches),
        "group": args.group,
        "tokens": tokens,
        "padded_tokens": sum(max(len(s.input_ids) for s in b) * len(b) for b in batches),
        "torch_threads": torch.get_num_threads(),
        "bare_tokens_per_s": tokens * args.rounds / seconds["bare"],
        "extract_tokens_per_s": tokens * args.rounds / seconds["extract"],
        "ratio": seconds["bare"] / seconds["extract"],
        "rounds": args.rounds,
        "round_ratios": [s["bare"] / s["extract"] for s in rounds],
        "goal_ratio_min": 0.90,
        "store_bytes_per_token": sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / tokens,
    }


def time_round(
    backend: Any, root: Path, meta: Any, groups: list[list[Any]], first: int, sync: Any
) -> dict[str, float]:
    """Seconds of each side over every group of batches, extraction writing a fresh cache at `root`; which side
    goes first alternates from group to group (starting with the extraction when `first` is even)."""
    writer = CacheWriter(root, meta, 0, 1).open()
    ahead = BatchPipeline(writer, lambda n: None)
    seconds = {"bare": 0.0, "extract": 0.0}

    def run_bare(group: list[Any]) -> None:
        for batch in group:
            backend.bare_forward([s.input_ids for s in batch])

    def run_extract(group: list[Any]) -> None:
        for batch in group:
            ahead.submit(backend, batch)
        ahead.drain()

    for i, group in enumerate(groups):
        for name, fn in (("bare", run_bare), ("extract", run_extract))[:: 1 if (i + first) % 2 else -1]:
            t = time.perf_counter()
            fn(group)
            sync()
            seconds[name] += time.perf_counter() - t
    t = time.perf_counter()
    writer.close()
    seconds["extract"] += time.perf_counter() - t
    return seconds


def report(result: dict[str, Any]) -> None:
    print(
        f"\n{result['samples']} samples in {result['batches']} batches, {result['tokens']} tokens "
        f"({result['padded_tokens']} padded), {result['device']}, {result['torch_threads']} threads\n"
    )
    print("| path | tokens/s | vs bare forward |")
    print("|---|---:|---:|")
    print(f"| bare HF forward | {result['bare_tokens_per_s']:.0f} | 1.00 |")
    print(
        f"| extraction (hooks + top-k + cache write) | {result['extract_tokens_per_s']:.0f} | "
        f"{result['ratio']:.3f} |"
    )
    if result["rounds"] > 1:
        print("\nper round: " + " / ".join(f"{x:.3f}" for x in result["round_ratios"]))


if __name__ == "__main__":
    main()
