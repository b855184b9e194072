"""How large `make quality` runs: `--scale`, and `auto`, which sizes the run to the hour on the host it runs on from
a timed forward of the target."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from quality_settings import (
    BUDGET_MARGIN,
    BUDGET_MIN,
    MODEL,
    REFERENCE,
    SCALE_RANGE,
    QualityError,
    ask_package,
    write_atomic,
)


def parse_scale(text: str) -> float | None:
    """--scale: a positive factor, or None for `auto` (sized to the budget by `auto_scale`)."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise QualityError(f"--scale must be 'auto' or a positive number, got {text!r}", 2)
    return value


def scale_for(probe_tokens_per_s: float) -> dict[str, float]:
    """The scale that fits BUDGET_MIN x BUDGET_MARGIN on a host whose target forward runs `probe_tokens_per_s`.

    The reference run's minutes scale with the forward's speed: total(scale) = (fixed_min + per_scale_min x scale) x
    reference / probe. E.g. a probe of 2,145 tokens/s, three times the reference's, predicts (13.9 + 34.0 x s) / 3
    minutes: the largest scale, 3.0, fills 38.6 of them. At the reference's speed, 715, the scale is 1.232 and the
    prediction 55.8 minutes (93 % of 60).
    """
    ratio = (
        REFERENCE["probe_tokens_per_s"] / probe_tokens_per_s
    )  # > 1: this host is slower than the reference
    room = BUDGET_MIN * BUDGET_MARGIN / ratio - REFERENCE["fixed_min"]
    scale = min(max(room / REFERENCE["per_scale_min"], SCALE_RANGE[0]), SCALE_RANGE[1])
    predicted = (REFERENCE["fixed_min"] + REFERENCE["per_scale_min"] * scale) * ratio
    return {
        "scale": round(scale, 3),
        "probe_tokens_per_s": round(probe_tokens_per_s, 1),
        "predicted_min": round(predicted, 1),
    }


PROBES = 2  # timed forwards per sizing; the faster one sizes the run


def auto_scale(root: Path) -> dict[str, Any]:
    """`scale_for` this host, from the faster of PROBES timed target forwards (`probe`).

    One probe can read low: on 2026-11-27 one read 887 tokens/s at the start of a run on a host where three later
    probes read 1,001 to 1,017 and the run's stages ran at the speed of a 1,000 tokens/s host (49.4 minutes where 887
    predicted 55.8). Whatever else runs only slows a probe down, so the faster reading is the host's.
    Kept in DIR/scale.json: a re-run (after an interruption) keeps the sizes its finished stages were made with.
    """
    path = root / "scale.json"
    if path.exists():
        return json.loads(path.read_text())
    readings = [probe() for _ in range(PROBES)]
    out: dict[str, Any] = {**scale_for(max(readings)), "probe_readings": [round(r, 1) for r in readings]}
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(out, indent=2) + "\n")
    return out


# The target's forward in the package's compute dtype: 4 x 512 random tokens, best of six after a warm-up.
PROBE = f"""
import time, torch
from transformers import AutoModelForCausalLM
from peagle_pipeline.hardware import resolve_compute_dtype
dtype = {{"bf16": torch.bfloat16, "fp32": torch.float32}}[resolve_compute_dtype("auto", "cpu")]
model = AutoModelForCausalLM.from_pretrained({str(MODEL)!r}, dtype=dtype).eval()
ids = torch.randint(100, 40000, (4, 512), generator=torch.Generator().manual_seed(0))
best = float("inf")
with torch.inference_mode():
    model(ids[:1, :256])
    for _ in range(6):
        start = time.perf_counter()
        model(ids)
        best = min(best, time.perf_counter() - start)
print(ids.numel() / best)
"""


def probe() -> float:
    """Tokens/s of the target's forward on this host (about 23 s with the model load on 2 cores)."""
    return float(ask_package(PROBE).splitlines()[-1])


def bf16_units() -> list[str]:
    """This CPU's bf16 units as the package sees them (empty: a host where bf16 is emulated and slow)."""
    try:  # only for the report: an unanswered question must not cost the run's doc
        return ask_package(
            "from peagle_pipeline.hardware import cpu_bf16_flags; print(*cpu_bf16_flags())"
        ).split()
    except QualityError:
        return []


def compute_dtype_line() -> str | None:
    """The package's `auto` choice on this CPU and its reason (e.g. "compute dtype fp32 on cpu (auto: ...)")."""
    try:
        return ask_package(
            "from peagle_pipeline.hardware import describe_compute_dtype as d, resolve_compute_dtype as r; "
            "print(d('auto', 'cpu', r('auto', 'cpu')))"
        )
    except QualityError:
        return None


# The main run is sized last, from the minutes the stages before it left (`--scale auto` only): the scale above sizes
# the data and the ablation, and a host that runs slower or faster than its probe said, or a resumed run, would
# otherwise miss the hour (a resumed run of 2026-11-27 took 61.8 minutes). What stays after the main run is the
# evaluation, whose minutes REFERENCE predicts from the probe; the margins below cover the worst hour seen so far.
EVAL_SLACK = 1.1  # the evaluation took 0.97x and 1.12x its prediction in two runs of one host (2026-11-27)
STEP_SLACK = 1.1  # the main run's steps took up to 1.12x the ablation rows' median step in a slowing hour
# the main run's start, 12 held-out estimates, 3 checkpoints and the curve's exports (about 60 s measured)
MAIN_OVERHEAD_S = 75.0
FINISH_MARGIN_MIN = 0.5


def median_step_s(runs: list[Path]) -> float | None:
    """The median seconds per step that `train` logged (RUN/metrics.jsonl) over `runs`; None when none logged."""
    times = []
    for run in runs:
        path = run / "metrics.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record.get("kind") == "train" and record.get("step_time"):
                    times.append(float(record["step_time"]))
    return statistics.median(times) if times else None


def main_steps_for(spent_s: float, step_s: float, probe_tokens_per_s: float, multiple: int) -> dict[str, Any]:
    """Steps for the main run so that the run ends within BUDGET_MIN: the minutes left after `spent_s` seconds of
    stages, less the evaluation's predicted minutes (x EVAL_SLACK), the main run's overhead and FINISH_MARGIN_MIN,
    at `step_s` (x STEP_SLACK) a step; rounded down to a multiple of `multiple`, at least `multiple`.

    E.g. 27 minutes spent, 0.33 s a step, a probe of 1,017 tokens/s: the evaluation is predicted at
    13.9 x 715 / 1,017 = 9.8 minutes, so 60 - 0.5 - 27 - 10.7 - 1.25 = 20.5 minutes are left for 3,384 steps of
    0.363 s (a multiple of 12: 3,384).
    """
    eval_min = REFERENCE["fixed_min"] * REFERENCE["probe_tokens_per_s"] / probe_tokens_per_s
    left_s = (BUDGET_MIN - FINISH_MARGIN_MIN - eval_min * EVAL_SLACK) * 60 - spent_s - MAIN_OVERHEAD_S
    steps = max(int(left_s / (step_s * STEP_SLACK)) // multiple * multiple, multiple)
    return {
        "steps": steps,
        "step_s": round(step_s, 4),
        "spent_min": round(spent_s / 60, 1),
        "left_min": round(left_s / 60, 1),
        "eval_predicted_min": round(eval_min, 1),
    }


def size_main_run(
    root: Path, sizing: dict[str, Any], spent_s: float, rows: list[Path], multiple: int
) -> dict[str, Any]:
    """`main_steps_for` from the rows' measured step time, kept in DIR/main.json so that a re-run keeps it."""
    path = root / "main.json"
    if path.exists():
        return json.loads(path.read_text())
    step_s = median_step_s(rows)
    if step_s is None:
        raise QualityError(f"no step times in {', '.join(str(r / 'metrics.jsonl') for r in rows)}", 1)
    out = main_steps_for(spent_s, step_s, sizing["probe_tokens_per_s"], multiple)
    write_atomic(path, json.dumps(out, indent=2) + "\n")
    return out


def sizing_text(sizing: dict[str, Any], scale: float) -> str:
    """The report's sentence on the run's size: the factor, and how `auto` chose it and the main run's steps."""
    if sizing.get("budget_min"):
        main = sizing.get("main")
        if not main:  # the runs before 2026-11-28 scaled the main run's steps with the rest
            return (
                f" Data and step budgets x {scale} (`--scale auto`: the target's forward ran "
                f"{sizing['probe_tokens_per_s']:.0f} tokens/s here, which predicted {sizing['predicted_min']:.0f} "
                f"minutes for {sizing['budget_min']:.0f} of budget)."
            )
        return (
            f" Data and ablation step budgets x {scale} (`--scale auto`: the target's forward ran "
            f"{sizing['probe_tokens_per_s']:.0f} tokens/s here)."
            + (
                f" The main run's {main['steps']:,} steps were sized from the {main['left_min']:.1f} minutes left "
                f"for them after {main['spent_min']:.1f} minutes of stages before it and the evaluation's predicted "
                f"{main['eval_predicted_min']:.1f}, at the ablation rows' {main['step_s']:.3f} s a step."
            )
        )
    return f" Data and step budgets x {scale} (`--scale`)." if scale != 1.0 else ""
