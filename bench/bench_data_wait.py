"""Data-wait fraction of training: a short real training run on a SmolLM2 cache (goal: < 5 % of step time).

The trainer measures, for every optimizer step, the time spent waiting for the next packed batch from its
DataLoader (worker processes reading the cache in random order) and logs `data_wait` = wait / step time and
`step_time` per log window in RUN/metrics.jsonl. This script runs `peagle-pipeline train` as a subprocess
(the real CLI, real cache, the compute dtype `auto` picks, as the demo) and reads those records back; a step in
emulated bf16 (a CPU without bf16 units) runs many times slower and would hide the wait. The first log window holds the
worker start-up (a one-time cost) and is reported apart; the goal applies to the steady-state windows.
Without --cache it extracts a small SmolLM2 cache first (kept under --workdir, reused by later runs).
With --s3-mbit N the cache is uploaded to a real S3 server on localhost (moto, bench/s3_local.py) and training
reads it by its s3:// URL through a proxy limited to N Mbit/s with --s3-latency-ms per read (the object-store row).

    python -m bench.bench_data_wait --out bench/results/data_wait.json [--cache DIR] [--quick]
    python -m bench.bench_data_wait --out bench/results/data_wait_s3.json --s3-mbit 200 [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import DEMO_DATA, DEMO_MODEL, ROOT


def cli(*args: str, env: dict[str, str] | None = None) -> None:
    """Run `peagle-pipeline ARGS` with this interpreter (its progress and errors go to the terminal)."""
    cmd = [sys.executable, "-m", "peagle_pipeline.cli", *args]
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if code != 0:
        raise SystemExit(f"error: `peagle-pipeline {args[0]}` failed with exit code {code} (message above)")


def ensure_cache(workdir: Path, model: str, data: str, samples: int, max_length: int) -> Path:
    """A small SmolLM2 cache under workdir (extract resumes / no-ops when it is already complete)."""
    cache = workdir / f"smollm2-{samples}x{max_length}"
    cli(
        "extract",
        "--model",
        model,
        "--data",
        data,
        "--output",
        str(cache),
        "--max-samples",
        str(samples),
        "--max-length",
        str(max_length),
        "--batch-tokens",
        "4096",
    )
    return cache


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Time-weighted data-wait fractions: all windows, and steady state (the first window apart)."""
    windows, prev = [], 0  # (steps, seconds, wait fraction, record) per log window
    for r in (r for r in records if r.get("kind") == "train"):
        steps, prev = int(r["step"]) - prev, int(r["step"])
        windows.append((steps, steps * float(r["step_time"]), float(r["data_wait"]), r))
    if not windows:
        raise SystemExit("error: the training run logged no train records")
    steady = windows[1:] or windows

    def frac(ws: list) -> float:
        return sum(t * f for _, t, f, _ in ws) / max(sum(t for _, t, _, _ in ws), 1e-9)

    return {
        "windows": [
            {
                "step": r["step"],
                "data_wait": f,
                "step_time": r["step_time"],
                "tokens_per_s": r.get("tokens_per_s"),
            }
            for _, _, f, r in windows
        ],
        "data_wait_all": frac(windows),
        "data_wait_first_window": windows[0][2],
        "data_wait_steady": frac(steady),
        "mean_step_time_steady": sum(t for _, t, _, _ in steady) / max(1, sum(n for n, _, _, _ in steady)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--cache", default=None, help="existing cache (default: extract a small one under --workdir)"
    )
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--workdir", default=str(ROOT / ".demo/bench"), help="where the extracted cache is kept")
    ap.add_argument("--samples", type=int, default=48, help="conversations to extract without --cache")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--tokens-per-step", type=int, default=1024)
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="8 steps on a 16-sample cache")
    ap.add_argument(
        "--s3-mbit", type=float, default=None, help="train from a local S3 server limited to this"
    )
    ap.add_argument("--s3-latency-ms", type=float, default=5.0, help="added delay per read from that server")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.log_every, args.samples = 8, 2, min(args.samples, 16)

    cache = (
        Path(args.cache)
        if args.cache
        else ensure_cache(Path(args.workdir), args.model, args.data, args.samples, args.max_length)
    )
    run = Path(tempfile.mkdtemp(prefix="bench-data-wait-")) / "run"
    with contextlib.ExitStack() as stack:
        source, env = str(cache), None
        if args.s3_mbit:
            from bench.s3_local import LocalS3

            s3 = stack.enter_context(LocalS3(args.s3_mbit, args.s3_latency_ms))
            s3.upload(cache, "bench/cache")
            source, env = "s3://bench/cache", s3.env
        try:
            train(args, source, run, env)
            from peagle_pipeline.stages.train.metrics import read_metrics

            res = summarise(read_metrics(run))
        finally:
            shutil.rmtree(run.parent, ignore_errors=True)
    res.update(
        cache=source,
        s3_mbit=args.s3_mbit,
        s3_latency_ms=args.s3_latency_ms if args.s3_mbit else None,
        steps=args.steps,
        tokens_per_step=args.tokens_per_step,
        num_workers=args.num_workers,
        goal_max=0.05,
        quick=args.quick,
        load_avg=os.getloadavg()[0],
    )
    where = f"s3:// at {args.s3_mbit:g} Mbit/s, {args.s3_latency_ms:g} ms" if args.s3_mbit else "local disk"
    print(f"\n| windows ({where}) | data wait (fraction of step time) |\n|---|---:|")
    print(f"| first (worker start-up) | {res['data_wait_first_window']:.3f} |")
    print(f"| steady state | {res['data_wait_steady']:.3f} |")
    print(f"| all | {res['data_wait_all']:.3f} |")
    print(
        f"\nsteady-state step time {res['mean_step_time_steady']:.2f} s ({args.tokens_per_step} tokens/step)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


def train(args: argparse.Namespace, cache: str, run: Path, env: dict[str, str] | None) -> None:
    """The measured training run: `peagle-pipeline train` on `cache` (a directory or an s3:// URL)."""
    cli(
        "train",
        "--cache",
        cache,
        "--output",
        str(run),
        "--steps",
        str(args.steps),
        "--tokens-per-step",
        str(args.tokens_per_step),
        "--draft-layers",
        "1",
        "--depths",
        "4",
        "--draft-vocab-size",
        "8192",
        "--precision",
        "auto",
        "--num-workers",
        str(args.num_workers),
        "--eval-samples",
        "0",
        "--log-every",
        str(args.log_every),
        "--save-every",
        str(10 * args.steps),
        "--warmup",
        "2",
        "--no-export",
        env=env,
    )


if __name__ == "__main__":
    main()
