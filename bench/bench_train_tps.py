"""Tokens/s of the trainer's own step (`Trainer.train_step`: COD layout, mask, forward, loss, backward, clip and
the optimizer) on a real cache, with a run's settings.

    python -m bench.bench_train_tps -c .demo/run/train.yaml [--steps 20] [--warmup 5] [--out FILE.json]

The settings come from a pipeline file (a run's `train.yaml`, or any file `train -c` reads); the run directory is
a temporary one (nothing is written beside the run). Batches are read before the clock starts, so the figure is
the step alone, not the data loader. `PEAGLE_CPU_BF16=0` measures fp32 on a CPU with bf16 units, as `train` would
compute on one without. Prints one line and writes JSON to --out when given.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from peagle_pipeline.config import TrainConfig, resolve
from peagle_pipeline.errors import PeagleError
from peagle_pipeline.stages.train.distributed import Dist
from peagle_pipeline.stages.train.trainer import Trainer


def measure(config: Path, steps: int, warmup: int) -> dict:
    """Time `steps` train steps after `warmup` ones; returns tokens/s, seconds per step and the compute dtype."""
    with tempfile.TemporaryDirectory() as tmp:
        over = {"output": str(Path(tmp) / "run"), "num_workers": 0, "eval_samples": 0}
        cfg = resolve(TrainConfig, config, {**over, "steps": steps + warmup})
        trainer = Trainer(cfg, Dist.setup("cpu"))
        stream = trainer.loader.iterate(trainer.cursor)
        batches = [next(stream)[1] for _ in range(steps + warmup)]
        for micro in batches[:warmup]:
            trainer.train_step(micro)
        start, tokens = time.perf_counter(), 0
        for micro in batches[warmup:]:
            tokens += trainer.train_step(micro).tokens
        seconds = time.perf_counter() - start
    return {
        "config": str(config),
        "precision": trainer.precision,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "seconds_per_step": seconds / steps,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "-c", "--config", type=Path, required=True, help="a run's train.yaml (or a pipeline file)"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not args.config.is_file():
        print(f"error: no pipeline file at {args.config}", file=sys.stderr)
        return 2
    try:
        fig = measure(args.config, args.steps, args.warmup)
    except PeagleError as err:  # a missing cache, a wrong setting: one line, the exit code
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(
        f"{fig['tokens_per_s']:,.0f} tokens/s ({fig['seconds_per_step'] * 1000:.0f} ms per step, "
        f"{fig['precision']}, {fig['steps']} steps, {fig['threads']} threads)"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(fig, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
