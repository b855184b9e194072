"""Peak training-step memory with 1 vs 4 sequence segments at 4k-token samples (goal: >= 2.5x lower), and the
longest sample that trains within a memory budget with 1 and with 4 segments (--budget-mib).

Each configuration runs in a fresh subprocess: it builds the SmolLM2-sized draft and the packed row, resets the
kernel's peak-RSS counter (/proc/self/clear_refs; ru_maxrss otherwise), runs one optimised step (forward and
backward per segment) and reports peak RSS minus the RSS before the step, overall and per segment (with the RSS each
segment starts from: what stays resident across segments). The embedding gradient is row-sparse, as the trainer makes
it on a single CPU rank; --dense-embedding measures the dense [V, H] gradient of GPU and multi-rank training.
The budget search bisects the length of one sample (a row of one sample) on a --step grid.
speculators' step is not measured here: it needs the benchmark env (`make setup-bench`, bench/bench_speculators.py).
Usage: python bench/bench_partition_memory.py --out bench/results/partition_memory.json [--tokens 4096]
    [--budget-mib 512 --max-tokens 32768]
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


def _peak_kib() -> int:
    return _status_kib("VmHWM") if _HWM else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> None:
    if _HWM:
        Path("/proc/self/clear_refs").write_text("5")


def _can_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


_HWM = _can_reset()


def child(args: argparse.Namespace) -> None:
    import torch

    from bench.bench_step import build_setup
    from peagle_pipeline.core.loss import Counted, kl_topk
    from peagle_pipeline.core.partition import forward_segment, plan_segments

    torch.set_num_threads(args.threads)
    model, vocab, lay, toks, aux, weight, ids, lp, _ = build_setup(
        args.tokens * args.samples, args.samples, args.depths
    )
    model.embed_tokens.sparse = not args.dense_embedding
    for p in model.parameters():  # gradients exist before the step in a training loop: not part of the peak
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    ew = lay.element_weight(weight)
    count = int(ew.sum())
    total = torch.zeros(())
    segs = plan_segments(lay, args.segments, ew)
    _reset_peak()
    base = _status_kib("VmRSS") if _HWM else _peak_kib()
    t0 = time.perf_counter()
    peaks, starts = [], []
    for seg in segs:  # as bench_step.optimised_step, with the peak read per segment
        starts.append((_status_kib("VmRSS") - base) / 1024 if _HWM else None)
        hidden, owned = forward_segment(model, lay, seg, toks, aux)
        t = lay.target[owned]
        out = kl_topk(
            hidden,
            model.lm_head.weight,
            ids[t],
            lp[t],
            Counted(ew[owned], lay.depth[owned], args.depths),
            vocab,
            args.chunk,
        )
        (out.loss_sum / count).backward()
        total += out.loss_sum.detach()
        del hidden, out
        peaks.append((_peak_kib() - base) / 1024)
        _reset_peak()
    secs = time.perf_counter() - t0
    row = {
        "segments": args.segments,
        "tokens_per_sample": args.tokens,
        "peak_mib": max(peaks),
        "segment_peaks_mib": peaks,
        "segment_start_mib": starts,
        "segment_elements": [len(s.index) for s in segs],
        "segment_owned": [int(s.owned.sum()) for s in segs],
        "method": "VmHWM" if _HWM else "ru_maxrss",
        "elements": len(lay),
        "loss": float(total),
        "count": count,
        "seconds": secs,
        "embedding_grad": "dense" if args.dense_embedding else "row-sparse",
    }
    print(json.dumps(row))


def run_child(args: argparse.Namespace, segments: int, tokens: int, samples: int) -> dict:
    """One step in a fresh process: its JSON row."""
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_partition_memory",
        "--child",
        "--segments",
        str(segments),
        "--tokens",
        str(tokens),
    ]
    cmd += ["--samples", str(samples), "--depths", str(args.depths), "--threads", str(args.threads)]
    cmd += ["--chunk", str(args.chunk)] + (["--dense-embedding"] if args.dense_embedding else [])
    # a fixed mmap threshold keeps glibc from retaining freed activation memory in the heap between
    # segments (its dynamic threshold would otherwise make RSS grow segment after segment)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def longest_within(args: argparse.Namespace, segments: int) -> dict:
    """The longest one-sample row (a multiple of --step tokens, <= --max-tokens) whose step peaks within the budget:
    doubling from --step, then bisection. Returns the length, its peak and every probe."""
    probes: dict[int, float] = {}

    def fits(n: int) -> bool:
        if n not in probes:
            probes[n] = run_child(args, segments, n, 1)["peak_mib"]
            print(f"  {segments} segment(s), {n} tokens: {probes[n]:.0f} MiB", file=sys.stderr)
        return probes[n] <= args.budget_mib

    step, top = args.step, args.max_tokens // args.step
    lo, hi = 0, None  # lo steps fit (0 = none known), hi steps do not
    k = 1
    while k <= top:
        if not fits(k * step):
            hi = k
            break
        lo, k = k, k * 2
    if hi is None:
        hi = top + 1
        if lo < top and fits(top * step):
            lo = top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    best = lo * step
    return {
        "segments": segments,
        "longest_tokens": best,
        "peak_mib": probes.get(best),
        "capped": best == top * step,
        "probes": {str(n): round(v, 1) for n, v in sorted(probes.items())},
    }


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
    ap.add_argument(
        "--dense-embedding", action="store_true", help="dense [V, H] embedding gradient (GPU, DDP)"
    )
    ap.add_argument(
        "--budget-mib", type=float, help="also find the longest sample whose step peaks within this"
    )
    ap.add_argument("--max-tokens", type=int, default=32768, help="longest sample the budget search tries")
    ap.add_argument("--step", type=int, default=1024, help="granularity of the budget search (tokens)")
    ap.add_argument("--segments", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if not args.out:
        ap.error("--out is required")
    rows = [run_child(args, n, args.tokens, args.samples) for n in (1, 4)]
    one, four = rows
    ratio = one["peak_mib"] / four["peak_mib"]
    same = abs(one["loss"] - four["loss"]) / abs(one["loss"])
    print("| segments | peak MiB (step) | peak MiB per segment | s/step |\n|---|---|---|---|")
    for r in rows:
        per = " / ".join(f"{x:.0f}" for x in r["segment_peaks_mib"])
        print(f"| {r['segments']} | {r['peak_mib']:.0f} | {per} | {r['seconds']:.1f} |")
    print(
        f"\n{ratio:.2f}x lower peak with 4 segments ({args.samples} x {args.tokens}-token samples, "
        f"{one['elements']} elements, {one['method']}, {one['embedding_grad']} embedding gradient); "
        f"loss rel diff {same:.1e}"
    )
    result = {
        "runs": rows,
        "ratio": ratio,
        "loss_rel_diff": same,
        "tokens_per_sample": args.tokens,
        "samples": args.samples,
        "loss_chunk": args.chunk,
        "embedding_grad": one["embedding_grad"],
        "speculators": "not measured here: its step runs in the benchmark env (make setup-bench, bench_speculators.py)",
    }
    if args.budget_mib:
        found = [longest_within(args, n) for n in (1, 4)]
        print(
            f"\n| segments | longest sample within {args.budget_mib:.0f} MiB | its peak MiB |\n|---|---|---|"
        )
        for f in found:
            more = "+" if f["capped"] else ""
            print(f"| {f['segments']} | {f['longest_tokens']}{more} | {f['peak_mib'] or 0:.0f} |")
        result["budget"] = {"budget_mib": args.budget_mib, "step": args.step, "search": found}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
