"""Peak training-step memory with 1 vs 4 sequence segments at 4k-token samples (SPEC §8: >= 2.5x lower).

Each configuration runs in a fresh subprocess: it builds the SmolLM2-sized draft and the packed row, resets the
kernel's peak-RSS counter (/proc/self/clear_refs; ru_maxrss otherwise), runs one optimised step (forward and
backward per segment) and reports peak RSS minus the RSS before the step.
Usage: python bench/bench_partition_memory.py --out bench/results/partition_memory.json [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(args: argparse.Namespace) -> None:
    import torch

    from bench.bench_step import build_setup, optimised_step

    torch.set_num_threads(args.threads)
    setup = build_setup(args.tokens * args.samples, args.samples, args.depths)
    model, vocab, lay, toks, aux, weight, ids, lp, _ = setup
    for p in model.parameters():  # gradients exist before the step in a training loop: not part of the peak
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        base, how = _status_kib("VmRSS"), "VmHWM"
    except OSError:
        base, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    t0 = time.perf_counter()
    loss, count = optimised_step(
        model,
        vocab,
        lay,
        toks,
        aux,
        weight,
        ids,
        lp,
        segments=args.segments,
        depths=args.depths,
        chunk=args.chunk,
    )
    secs = time.perf_counter() - t0
    peak = _status_kib("VmHWM") if how == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "segments": args.segments,
                "peak_mib": (peak - base) / 1024,
                "method": how,
                "elements": len(lay),
                "loss": float(loss),
                "count": count,
                "seconds": secs,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per sample")
    ap.add_argument(
        "--samples",
        type=int,
        default=2,
        help="samples in the packed row (2 x 4096 = the default 8192-token budget)",
    )
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--chunk", type=int, default=256, help="loss chunk (elements); bounds the [chunk, Vd] buffers"
    )
    ap.add_argument("--segments", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if not args.out:
        ap.error("--out is required")
    rows = []
    for n in (1, 4):
        cmd = [
            sys.executable,
            "-m",
            "bench.bench_partition_memory",
            "--child",
            "--segments",
            str(n),
            "--tokens",
            str(args.tokens),
            "--samples",
            str(args.samples),
            "--depths",
            str(args.depths),
            "--threads",
            str(args.threads),
            "--chunk",
            str(args.chunk),
        ]
        # a fixed mmap threshold keeps glibc from retaining freed activation memory in the heap between
        # segments (its dynamic threshold would otherwise make RSS grow segment after segment)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(args.threads)}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    one, four = rows
    ratio = one["peak_mib"] / four["peak_mib"]
    same = abs(one["loss"] - four["loss"]) / abs(one["loss"])
    print("| segments | peak MiB (step) | s/step |\n|---|---|---|")
    for r in rows:
        print(f"| {r['segments']} | {r['peak_mib']:.0f} | {r['seconds']:.1f} |")
    print(
        f"\n{ratio:.2f}x lower peak with 4 segments ({args.samples} x {args.tokens}-token samples, "
        f"{one['elements']} elements, {one['method']}); loss rel diff {same:.1e}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "runs": rows,
                "ratio": ratio,
                "loss_rel_diff": same,
                "tokens_per_sample": args.tokens,
                "samples": args.samples,
                "loss_chunk": args.chunk,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
