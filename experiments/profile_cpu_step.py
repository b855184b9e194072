"""Where a training step's time goes: `peagle-pipeline train` with torch.profiler around some of its steps.

    python experiments/profile_cpu_step.py --first 20 --steps 10 -- train --cache CACHE --output RUN [train flags]

Runs the real CLI in this process (the real `Trainer`, data and optimizer) and, for steps `first` to
`first + steps - 1`, records every op; then prints the ops by CPU time, the matmuls by shape, and the median time
of a step from step `first` on (the profiled steps included). Used for docs/results/what-we-learned.md ("A host without bf16 units"), with
`make quality`'s training settings (experiments/quality_settings.py `TRAIN`) on a cache of 120 ShareGPT records cut
at 384 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=20, help="the first profiled step (the ones before warm up)")
    ap.add_argument("--steps", type=int, default=10, help="how many steps to profile")
    args = ap.parse_args(argv[:cut])
    cli_args = argv[cut + 1 :]

    from torch.profiler import ProfilerActivity, profile

    from peagle_pipeline.cli import main as cli_main
    from peagle_pipeline.stages.train import trainer

    step = trainer.Trainer.train_step
    seen: list[float] = []
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def timed_step(self: Any, micro: Any) -> Any:
        n = len(seen) + 1
        if n == args.first:
            prof.__enter__()
        t0 = time.perf_counter()
        out = step(self, micro)
        seen.append(time.perf_counter() - t0)
        if n == args.first + args.steps - 1:
            prof.__exit__(None, None, None)
        return out

    trainer.Trainer.train_step = timed_step  # type: ignore[method-assign]
    code = cli_main(cli_args)
    if len(seen) < args.first + args.steps - 1:
        sys.exit(f"error: the run made {len(seen)} steps; ask for at least {args.first + args.steps - 1}")
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15))
    print(f"median step from step {args.first} on: {statistics.median(seen[args.first - 1 :]):.3f} s")
    sys.exit(code)


if __name__ == "__main__":
    main()
