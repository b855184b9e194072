"""`make compare`'s settings and arithmetic: the rows (method x draft layer style), the sizes, the equal training
time each row gets, and which rows the installed package can train (experiments/compare.py runs it)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from quality_settings import TRAIN, QualityError, ask_package

# Each row trains one draft from the same cache for the same minutes. `method` and `draft_arch` are the train
# settings that tell the rows apart; `seed` a second run of a row (its distance to the first is the noise figure).
ROWS: dict[str, dict[str, Any]] = {
    "peagle-llama": {"method": "peagle", "draft_arch": "llama"},
    "peagle-qwen3": {"method": "peagle", "draft_arch": "qwen3"},
    "eagle3-llama": {"method": "eagle3", "draft_arch": "llama"},
    "eagle3-qwen3": {"method": "eagle3", "draft_arch": "qwen3"},
    "peagle-llama-seed1": {"method": "peagle", "draft_arch": "llama", "seed": 1, "noise_of": "peagle-llama"},
}
# The Qwen3-style EAGLE-3 row is the one the hour may not hold: `--rows` adds it.
DEFAULT_ROWS = ("peagle-llama", "peagle-qwen3", "eagle3-llama", "peagle-llama-seed1")
DEFAULT_DIR, DEFAULT_DOC = ".compare", "docs/results/compare.md"
RESULTS_DIR = "bench/results"
BUDGET_MIN = 60.0
BUDGET_MARGIN = 0.93  # aim below the hour: stage times move by several % between runs of one host
DEPTHS = 4  # K served and trained (the goal figures are at K = 4)
# What every row shares: `make quality`'s recipe (one layer, K 4, Vd 8192, lr 2e-3, COD 0.3 / 0.05, the loss on
# every position, the fused layer started from the target's last layer). Steps come from the equal time.
ROW_TRAIN = {**TRAIN, "depths": DEPTHS, "eval_samples": 32, "log_every": 10}
# Sizes at --scale 1 (`auto`: scaled by the target's forward speed on this host against the reference's, so the
# data takes about the same minutes on every host). The evaluation does not scale: the prompt sets are whole.
REFERENCE_PROBE = (
    976.0  # tokens/s of `quality_sizing.probe` on the AMD EPYC host of `make quality` (2026-11-28)
)
BASE = {
    # 732 records were regenerated in 3.5 minutes and extracted in 2.3 there (docs/results/quality.md, on-multi)
    "source_conversations": 900,
    "max_new_tokens": 160,
    "max_length": 384,
    "generate_chunk": 256,
    "eval_max_tokens": 64,
    "mtbench_prompts": 80,
    "humaneval_prompts": 164,
    "speed_prompts": 24,
}
SCALE_RANGE = (0.3, 3.0)
EVAL_CONCURRENCY = 16  # AL read with 16 requests in flight (the same AL up to numerics, several times faster)
# Minutes per engine and prompt on the reference host: `make quality`'s evaluation (6 engines x 160 prompts at 16 in
# flight, 7.1 min) and its concurrency-1 run (2 engines x 40 MT-Bench prompts, 2.2 min), 64 new tokens each.
EVAL_MIN_PER_PROMPT = {"batched": 7.1 / (6 * 160), "single": 2.2 / (2 * 40)}
CALIBRATION_STEPS = (
    24  # steps of the short run that times a row's step (the first ones are slower: the median)
)
ROW_OVERHEAD_S = (
    45.0  # a row's start, held-out estimates, checkpoint and export (the quality runs' main run: ~60)
)
FINISH_MARGIN_MIN = 0.5


class CompareError(QualityError):
    """A stage failed: one line, and the exit code to leave with."""


def say(text: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {text}", flush=True)


def scale_for(probe_tokens_per_s: float) -> float:
    """The data's factor on a host whose target forward runs `probe_tokens_per_s` (the reference's: 1.0)."""
    return round(min(max(probe_tokens_per_s / REFERENCE_PROBE, SCALE_RANGE[0]), SCALE_RANGE[1]), 3)


def eval_minutes(rows: int, sizes: dict[str, Any], probe_tokens_per_s: float) -> float:
    """Predicted minutes of both evaluations: every row and the plain target on MT-Bench and HumanEval at 16 in
    flight, then on `speed_prompts` MT-Bench prompts one at a time; slower hosts take longer in proportion."""
    engines = rows + 1
    batched = (
        engines * (sizes["mtbench_prompts"] + sizes["humaneval_prompts"]) * EVAL_MIN_PER_PROMPT["batched"]
    )
    single = engines * sizes["speed_prompts"] * EVAL_MIN_PER_PROMPT["single"]
    return (batched + single) * REFERENCE_PROBE / probe_tokens_per_s


def timed_as(name: str, rows: list[str]) -> str:
    """The row whose calibrated step time sets `name`'s steps: its `noise_of` row when that one runs too (the two
    runs of one row then differ in the seed alone), else itself."""
    base = ROWS[name].get("noise_of")
    return str(base) if base in rows else name


def row_steps(
    step_s: dict[str, float], spent_s: float, eval_min: float, budget_min: float = BUDGET_MIN
) -> dict[str, Any]:
    """Steps per row so that every row trains for the same seconds and the run ends within `budget_min`.

    The minutes left after `spent_s` (data, calibration) and the predicted evaluation, less each row's overhead
    and a margin, are split evenly; a row's steps are its share over its own step time (a step of EAGLE-3 runs the
    layer K times over the row, one of P-EAGLE about 1.4 times at this recipe's COD, so their counts differ).
    E.g. 12 minutes spent, 12 predicted for the evaluation, two rows at 0.3 and 0.6 s a step: (60 x 0.93 - 0.5 -
    12 - 12) x 60 - 2 x 45 = 1,788 s, 894 s each: 2,980 and 1,490 steps.
    """
    left_s = (budget_min * BUDGET_MARGIN - FINISH_MARGIN_MIN - eval_min) * 60 - spent_s
    left_s -= ROW_OVERHEAD_S * len(step_s)
    share = max(left_s / max(len(step_s), 1), 0.0)
    steps = {name: max(int(share / s), CALIBRATION_STEPS) for name, s in step_s.items()}
    return {
        "train_s_per_row": round(share, 1),
        "steps": steps,
        "step_s": {k: round(v, 4) for k, v in step_s.items()},
    }


def median_step_s(run: Path) -> float | None:
    """The median seconds per step that `train` logged in RUN/metrics.jsonl (None when none)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return None
    times = [
        float(r["step_time"])
        for r in map(json.loads, path.read_text().splitlines())
        if r.get("kind") == "train" and r.get("step_time")
    ]
    return statistics.median(times) if times else None


def trainable(rows: list[str], choices: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """(rows the package can train, one line per row it cannot): `choices` are the values its `train` takes for
    `method` and `draft_arch` (`package_choices`); a package without the setting takes only its default."""
    keep, skipped = [], []
    for name in rows:
        row = ROWS[name]
        missing = [
            f"--{key.replace('_', '-')} {row[key]}"
            for key in ("method", "draft_arch")
            if row[key] not in choices.get(key, [DEFAULT_CHOICE[key]])
        ]
        if missing:
            skipped.append(f"skipped {name}: this package's `train` has no {' or '.join(missing)}")
        elif row.get("noise_of") and row["noise_of"] not in keep:
            skipped.append(f"skipped {name}: it repeats {row['noise_of']}, which does not run")
        else:
            keep.append(name)
    return keep, skipped


# What a package without the setting trains: P-EAGLE drafts with the target family's layers (Llama for SmolLM2).
DEFAULT_CHOICE = {"method": "peagle", "draft_arch": "llama"}


def package_choices() -> dict[str, list[str]]:
    """The values the installed package's `train` takes for `method` and `draft_arch` (absent: no such setting)."""
    code = (
        "import json; from peagle_pipeline.config import TrainConfig, field_choices; import dataclasses; "
        "names = {f.name for f in dataclasses.fields(TrainConfig)}; "
        "print(json.dumps({k: list(field_choices(TrainConfig, k)) for k in ('method', 'draft_arch') if k in names}))"
    )
    return dict(json.loads(ask_package(code).splitlines()[-1]))


def row_flags(name: str, choices: dict[str, list[str]]) -> dict[str, Any]:
    """The train settings of a row: the shared recipe, its method and layer style (only those the package has: a
    package without `method` trains P-EAGLE), and its seed."""
    row = ROWS[name]
    out = dict(ROW_TRAIN)
    for key in ("method", "draft_arch"):
        if key in choices:
            out[key] = row[key]
    if "seed" in row:
        out["seed"] = row["seed"]
    return out
