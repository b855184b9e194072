"""Extraction overhead: HF-backend extraction tokens/s vs the bare HF forward over the same batches (SPEC section 8).

Both sides get the same padded batches (planned exactly as `peagle-pipeline extract` plans them):
  - bare: `HFBackend.bare_forward` = plain `model(input_ids, attention_mask)` (logits, no hooks, no top-k);
  - extraction: `HFBackend.forward` (hooks, chunked log-softmax/top-k) + conversion to stored dtypes +
    `CacheWriter.add` (zstd shards, checksums, commits) into a real cache.
Batches alternate which side runs first to cancel drift on a shared machine. Goal: ratio >= 0.90.
Prints a Markdown table; writes JSON to --out.

    python bench/bench_extract.py --out bench/results/extract.json [--model DIR --data FILE --samples 24]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_io import write_result  # noqa: E402

from peagle_pipeline.cache import layout  # noqa: E402
from peagle_pipeline.cache.writer import CacheWriter  # noqa: E402
from peagle_pipeline.config import ExtractConfig  # noqa: E402
from peagle_pipeline.stages import extract as stage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / ".demo/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--data", default=str(ROOT / ".demo/data/sharegpt.jsonl"))
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from peagle_pipeline.backends.pieces import read_target_info
    from peagle_pipeline.backends.registry import get_backend
    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.data.formats import iter_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    try:
        cfg = ExtractConfig(
            model=args.model,
            data=[args.data],
            output=str(work / "cache"),
            max_samples=args.samples,
            max_length=args.max_length,
            batch_tokens=args.batch_tokens,
        )
        info = read_target_info(cfg.model)
        layer_ids = stage.resolve_layers(cfg, info.num_hidden_layers)
        meta = stage.build_meta(cfg, info, layer_ids, 1)
        root = stage.prepare_output(cfg, meta)
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(cfg.model))
        rows = stage.rank_rows(iter_rows(cfg.data), 0, 1, cfg.max_samples)
        plan = stage.plan_batches(
            stage.render_rows(rows, renderer, cfg.max_length, cfg.overlong), cfg.batch_tokens
        )
        batches = [b for b in plan if isinstance(b, list)]
        backend = get_backend(cfg.backend, stage.backend_settings(cfg), layer_ids)
        backend.forward([s.input_ids for s in batches[0][:1]])  # warm-up (allocator, kernels)
        backend.bare_forward([s.input_ids for s in batches[0][:1]])
        writer = CacheWriter(root, meta, 0, 1).open()
        bare_s = extract_s = 0.0
        tokens = padded = 0
        for i, batch in enumerate(batches):
            ids = [s.input_ids for s in batch]

            def run_bare(ids: list[list[int]] = ids) -> float:
                t = time.perf_counter()
                backend.bare_forward(ids)
                return time.perf_counter() - t

            def run_extract(batch: list = batch, ids: list[list[int]] = ids) -> float:
                t = time.perf_counter()
                for sample, out in zip(batch, backend.forward(ids), strict=True):
                    writer.add(sample.ordinal, sample.record, stage.to_sample_data(sample, out, meta))
                return time.perf_counter() - t

            if i % 2:
                extract_s += run_extract()
                bare_s += run_bare()
            else:
                bare_s += run_bare()
                extract_s += run_extract()
            tokens += sum(len(x) for x in ids)
            padded += max(len(x) for x in ids) * len(ids)
        t = time.perf_counter()
        writer.close()
        extract_s += time.perf_counter() - t
        backend.close()
        store = root / layout.STORES_DIR / layout.store_name(0, 1)
        result = {
            "model": args.model,
            "samples": sum(len(b) for b in batches),
            "batches": len(batches),
            "tokens": tokens,
            "padded_tokens": padded,
            "torch_threads": torch.get_num_threads(),
            "bare_tokens_per_s": tokens / bare_s,
            "extract_tokens_per_s": tokens / extract_s,
            "ratio": bare_s / extract_s,
            "goal_ratio_min": 0.90,
            "store_bytes_per_token": sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / tokens,
        }
        print(
            f"\n{result['samples']} samples in {len(batches)} batches, {tokens} tokens ({padded} padded), "
            f"{result['torch_threads']} threads\n"
        )
        print("| path | tokens/s | vs bare forward |")
        print("|---|---:|---:|")
        print(f"| bare HF forward | {result['bare_tokens_per_s']:.0f} | 1.00 |")
        print(
            f"| extraction (hooks + top-k + cache write) | {result['extract_tokens_per_s']:.0f} | "
            f"{result['ratio']:.3f} |"
        )
        write_result(args.out, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
