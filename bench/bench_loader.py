"""Loader throughput per CPU core for each stored hidden dtype (bf16, fp8, nf4), decode included, next to the
tokens/s a GPU training step consumes; and the bytes per token of each (the nf4 aux states against bf16's: a size
goal, <= 0.30x).

One real HF extraction (bf16, compress none; bench/bench_cache.py's source) is written through the real writer three
times, `compress: auto`, its aux states stored as bf16, fp8 and nf4 (`layout.to_storage`, as `extract` stores them).
A read = `Cache.read_sample` (the trainer's loader reads samples so: shard bytes, crc32c checks, decode to bf16)
with every tensor owned in memory, in random order, with one torch thread (a DataLoader worker's), best of
--repeats passes with the files in the page cache. tokens/s per core = tokens read / seconds; a trainer needs
`need / per core` loader workers to keep a step fed.

    python -m bench.bench_loader --out bench/results/loader.json [--samples 24 --max-length 1024 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_cache import dir_bytes, extract_source
from bench.common import DEMO_DATA, DEMO_MODEL, write_result
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.cache.writer import CacheWriter, SampleData, SampleRecord

# Tokens/s a bf16 training step of a SmolLM2 draft consumes on one H200 (the GPU runs' step rate x tokens per step).
H200_STEP_TOKENS_PER_S = 300_000
DTYPES = {"bf16": "bfloat16", "fp8": layout.FP8, "nf4": layout.NF4}
AUX_RATIO_GOAL = 0.30  # nf4 aux bytes per token vs bf16's


def rewrite(src: Any, out: Path, hidden_dtype: str) -> Path:
    """Our cache (compress auto, no last hidden) of the source's samples, aux stored as `hidden_dtype`."""
    import torch

    meta = CacheMeta.from_dict(
        {**src.meta.to_dict(), "has_last_hidden": False, "compress": "auto", "hidden_dtype": hidden_dtype}
    )
    out.mkdir(parents=True)
    (out / layout.CACHE_META).write_text(json.dumps(meta.to_dict()))
    w = CacheWriter(out, meta, 0, 1).open()
    for ordinal, row in enumerate(src.samples.itertuples(index=False)):
        a = src.read_arrays(int(row.sample_id))
        aux = layout.to_storage(torch.from_numpy(a["aux_hidden"]).view(torch.bfloat16), hidden_dtype)
        data = SampleData(a["input_ids"], a["loss_mask"], aux, a["topk_ids"], a["topk_logprobs"])
        record = SampleRecord(int(row.sample_id), row.source, int(row.source_row), bool(row.truncated))
        w.add(ordinal, record, data)
    w.close()
    return out


def read_rate(cache: Any, ids: list[int], repeats: int, seed: int = 0) -> float:
    """Best tokens/s over `repeats` random-order passes of `read_sample` (one thread), every tensor owned."""
    rng = random.Random(seed)
    best = 0.0
    for _ in range(repeats):
        order = ids[:]
        rng.shuffle(order)
        tokens, t0 = 0, time.perf_counter()
        for sid in order:
            s = cache.read_sample(sid)
            for t in (s.input_ids, s.loss_mask, s.aux_hidden, s.topk_ids, s.topk_logprobs):
                t.clone()
            tokens += int(s.input_ids.numel())
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def aux_bytes(root: Path) -> int:
    return sum(
        f.stat().st_size
        for f in (root / layout.STORES_DIR).rglob("*")
        if f.is_file() and "aux_hidden" in f.parts
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--samples", type=int, default=24, help="conversations to extract")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3, help="random-order read passes (best is kept)")
    ap.add_argument(
        "--quick", action="store_true", help="smoke-test sizes (4 conversations, 256 tokens, 1 pass)"
    )
    ap.add_argument("--workdir", default=None, help="keep outputs here (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.max_length, args.repeats = 4, 256, 1

    import torch

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-loader-"))
    try:
        extract_source(work / "source", args.model, args.data, args.samples, args.max_length)
        src = open_cache(work / "source")
        caches = {}
        for name, logical in DTYPES.items():
            shutil.rmtree(work / name, ignore_errors=True)
            caches[name] = open_cache(rewrite(src, work / name, logical))
            assert verify_cache(caches[name]) == [], name
        ids = [int(i) for i in src.samples["sample_id"]]
        tokens = int(src.samples["length"].sum())
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        for cache in caches.values():  # warm: every file in the page cache, the decode tables built
            read_rate(cache, ids[:2], 1)
        rate = {name: read_rate(cache, ids, args.repeats) for name, cache in caches.items()}
        torch.set_num_threads(threads)
        per_token = {name: dir_bytes(work / name / layout.STORES_DIR) / tokens for name in caches}
        aux = {name: aux_bytes(work / name) / tokens for name in caches}
        result = {
            "model": args.model,
            "samples": len(ids),
            "tokens": tokens,
            "aux_layers": src.meta.aux_layer_ids,
            "hidden_size": src.meta.hidden_size,
            "tokens_per_s_per_core": rate,
            "need_tokens_per_s": H200_STEP_TOKENS_PER_S,
            "cores_for_need": {k: H200_STEP_TOKENS_PER_S / v for k, v in rate.items()},
            "bytes_per_token": per_token,
            "aux_bytes_per_token": aux,
            "nf4_aux_vs_bf16": aux["nf4"] / aux["bf16"],
            "nf4_vs_bf16": per_token["nf4"] / per_token["bf16"],
            "goals": {"nf4_aux_vs_bf16_max": AUX_RATIO_GOAL},
        }
        print(
            f"\n{len(ids)} samples, {tokens} tokens, H={src.meta.hidden_size}, aux {src.meta.aux_layer_ids}\n"
        )
        print("| stored aux dtype | bytes/token (all) | aux bytes/token | aux vs bf16 | reads, tokens/s per core "
              f"| cores for {H200_STEP_TOKENS_PER_S:,} tokens/s |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|")
        for k in caches:
            print(f"| {k} | {per_token[k]:,.0f} | {aux[k]:,.0f} | {aux[k] / aux['bf16']:.3f}x | {rate[k]:,.0f} | "
                  f"{result['cores_for_need'][k]:.1f} |")  # fmt: skip
        write_result(args.out, result)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
