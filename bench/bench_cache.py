"""Cache size and random-read speed vs the common per-sample format (goals: <= 0.80x the bytes,
>= 1.0x the reads).

One real HF extraction (with the last hidden state) feeds three outputs holding the same samples:
  - our cache with compress auto (the default: zstd for ids/mask/top-k log-probs, blosc-lz4 for top-k ids, raw
    hidden states with a crc32c per chunk), zstd (all arrays)
    and none: 3 aux layers (bf16 bits), top-k ids/log-probs, ids, mask;
  - the common per-sample format: one safetensors file per sample with input_ids, loss_mask (int64),
    hidden_states [T, 3H] and the last hidden state [T, H] (bf16).
Reports bytes per token (goal: ours <= 0.80x), that the aux states read back are bit-exact, and random-order
sample reads per second (goal: ours >= 1.0x), twice: warm (every file in the OS page cache) and cold (each format's
files evicted from the page cache before each pass, so the bytes come from disk). A read = load one sample and own its bytes in memory: every tensor
is cloned on both sides (safetensors maps files lazily; without touching the bytes it would time nothing), with one
torch thread as in a DataLoader worker, and the formats take turns within each round. Prints a Markdown table; writes
JSON to --out.

    python -m bench.bench_cache --out bench/results/cache.json [--model DIR --data FILE --samples 24]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import DEMO_DATA, DEMO_MODEL, write_result
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.writer import CacheWriter, SampleData, SampleRecord
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.stages.extract import stage


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rewrite(src, out: Path, compress: str) -> Path:
    """Our cache (no last hidden) from the source cache's arrays, through the real writer."""
    meta = CacheMeta.from_dict({**src.meta.to_dict(), "has_last_hidden": False, "compress": compress})
    out.mkdir(parents=True)
    (out / layout.CACHE_META).write_text(json.dumps(meta.to_dict()))
    w = CacheWriter(out, meta, 0, 1).open()
    for ordinal, row in enumerate(src.samples.itertuples(index=False)):
        a = src.read_arrays(int(row.sample_id))
        data = SampleData(a["input_ids"], a["loss_mask"], a["aux_hidden"], a["topk_ids"], a["topk_logprobs"])
        w.add(
            ordinal,
            SampleRecord(int(row.sample_id), row.source, int(row.source_row), bool(row.truncated)),
            data,
        )
    w.close()
    return out


def write_per_sample(src, out: Path) -> dict[int, Path]:
    """The common format: one safetensors file per sample (aux layers concatenated, plus the last hidden state)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    paths = {}
    for sid in src.samples["sample_id"].tolist():
        s = src.read_sample(int(sid))
        T = s.input_ids.shape[0]
        path = out / f"data_{sid}.safetensors"
        save_file(
            {
                "input_ids": s.input_ids.to(torch.int64),
                "loss_mask": s.loss_mask.to(torch.int64),
                "hidden_states": s.aux_hidden.reshape(T, -1).contiguous(),
                "last_hidden_state": s.last_hidden.contiguous(),
            },
            str(path),
        )
        paths[int(sid)] = path
    return paths


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the OS page cache (posix_fadvise DONTNEED; the files were synced), so the next
    pass reads them from disk, as training does when the cache is larger than RAM."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_reads(
    readers: dict, ids: list[int], repeats: int, seed: int, cold: dict[str, list[Path]] | None = None
) -> dict[str, float]:
    """Best samples/s of each reader over `repeats` rounds. Each round draws a fresh random order and runs every
    reader over it in turn, so a change in machine load hits all formats alike. `cold`: reader -> its files, evicted
    from the page cache before each pass (untimed)."""
    best = {name: 0.0 for name in readers}
    for r in range(repeats):
        order = ids[:]
        random.Random(seed + r).shuffle(order)
        for name, fn in readers.items():
            if cold is not None:
                evict(cold[name])
            t = time.perf_counter()
            for sid in order:
                fn(sid)
            best[name] = max(best[name], len(order) / (time.perf_counter() - t))
    return best


def extract_source(src_dir: Path, model: str, data: str, samples: int, max_length: int) -> None:
    """The benchmarks' source cache (last hidden states, uncompressed), extracted once into src_dir."""
    if not (src_dir / layout.CACHE_META).exists():
        stage.run(
            ExtractConfig(
                model=model,
                data=[data],
                output=str(src_dir),
                max_samples=samples,
                max_length=max_length,
                last_hidden=True,
                compress="none",
                batch_tokens=4096,
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--samples", type=int, default=24, help="conversations to extract")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5, help="random-order read passes (best is kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--workdir", default=None, help="keep outputs here (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        src_dir = work / "source"
        extract_source(src_dir, args.model, args.data, args.samples, args.max_length)
        src = open_cache(src_dir)
        variants = ("auto", "zstd", "none")
        for d in [f"ours-{c}" for c in variants] + ["per-sample"]:
            shutil.rmtree(work / d, ignore_errors=True)
        ours = {c: open_cache(rewrite(src, work / f"ours-{c}", c)) for c in variants}
        files = write_per_sample(src, work / "per-sample")
        tokens = int(src.samples["length"].sum())
        ids = [int(i) for i in src.samples["sample_id"]]

        # Bit-exactness: aux states read back from our cache == the backend's output == the per-sample files.
        from safetensors.torch import load_file

        exact = True
        for sid in ids:
            want = src.read_sample(sid).aux_hidden
            for cache in ours.values():
                exact &= bool(
                    torch.equal(cache.read_sample(sid).aux_hidden.view(torch.uint16), want.view(torch.uint16))
                )
            theirs = load_file(str(files[sid]))["hidden_states"].reshape(want.shape)
            exact &= bool(torch.equal(theirs.view(torch.uint16), want.view(torch.uint16)))

        size = {f"ours-{c}": dir_bytes(work / f"ours-{c}" / layout.STORES_DIR) / tokens for c in ours}
        size["per-sample"] = dir_bytes(work / "per-sample") / tokens

        def own(tensors) -> int:  # materialise every byte (same work on both sides)
            return sum(t.clone().numel() for t in tensors if t is not None)

        def read_ours(c: str, sid: int) -> int:
            s = ours[c].read_sample(sid)
            return own([s.input_ids, s.loss_mask, s.aux_hidden, s.topk_ids, s.topk_logprobs, s.last_hidden])

        readers = {f"ours-{c}": (lambda s, c=c: read_ours(c, s)) for c in ours}
        readers["per-sample"] = lambda s: own(load_file(str(files[s])).values())
        # Training reads samples in DataLoader workers, which PyTorch runs with one intra-op thread; a multi-threaded
        # clone would also make the timing hostage to whatever else the two cores are doing.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        reads = time_reads(readers, ids, args.repeats, 0)
        os.sync()  # freshly written pages must reach the disk before they can be evicted
        files_of = {f"ours-{c}": [f for f in (work / f"ours-{c}").rglob("*") if f.is_file()] for c in ours}
        files_of["per-sample"] = list(files.values())
        cold = time_reads(readers, ids, args.repeats, 0, cold=files_of)
        torch.set_num_threads(threads)
        result = {
            "model": args.model,
            "samples": len(ids),
            "tokens": tokens,
            "aux_layers": src.meta.aux_layer_ids,
            "hidden_size": src.meta.hidden_size,
            "topk": src.meta.topk,
            "aux_bit_exact": exact,
            "bytes_per_token": size,
            "size_ratio": {k: size[k] / size["per-sample"] for k in size},
            "reads_samples_per_s": reads,
            "reads_tokens_per_s": {k: v * tokens / len(ids) for k, v in reads.items()},
            "read_ratio": {k: reads[k] / reads["per-sample"] for k in reads},
            "cold_reads_samples_per_s": cold,
            "cold_read_ratio": {k: cold[k] / cold["per-sample"] for k in cold},
            "goals": {"size_ratio_max": 0.80, "read_ratio_min": 1.0},
        }
        print(
            f"\n{len(ids)} samples, {tokens} tokens, H={src.meta.hidden_size}, aux {src.meta.aux_layer_ids}, "
            f"top-{src.meta.topk}; aux bit-exact: {exact}\n"
        )
        print(
            "| format | bytes/token | size vs per-sample | warm reads (samples/s) | vs per-sample "
            "| cold reads (samples/s) | vs per-sample |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for k in size:
            print(
                f"| {k} | {size[k]:.0f} | {result['size_ratio'][k]:.3f} | {reads[k]:.0f} | "
                f"{result['read_ratio'][k]:.2f} | {cold[k]:.0f} | {result['cold_read_ratio'][k]:.2f} |"
            )
        write_result(args.out, result)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
