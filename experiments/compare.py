"""`make compare`: which drafter serves this target best, measured side by side in vLLM on this machine class (CPU).

    python experiments/compare.py --dir .compare [--scale auto|FACTOR] [--rows a,b] [--doc docs/results/compare.md]
        [--render]

SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) with ShareGPT prompts whose replies the target regenerates (on-policy
multi-turn, `make quality`'s carrier data). One cache, then one draft per row, every row trained for the same
minutes (steps = the row's share over its own step time, timed by a short calibration run: an EAGLE-3 step runs
the draft layer K times, a P-EAGLE step about 1.4 times at this recipe's COD):

    peagle-llama         P-EAGLE, Llama-style layer (what `train` makes for this target by default)
    peagle-qwen3         P-EAGLE, Qwen3-style layer (QK-norm; `--draft-arch qwen3`)
    eagle3-llama         EAGLE-3 (`--method eagle3`), Llama-style layer
    peagle-llama-seed1   peagle-llama again with seed 1: two runs of one row, the noise figure
    eagle3-qwen3         (only with --rows) EAGLE-3, Qwen3-style layer

A row whose method or layer style the installed package lacks is skipped with one line saying so. Every draft is
measured by one `evaluate` run in vLLM on MT-Bench (80 first turns) and HumanEval (164), K = 4, T = 0, AL read with
16 requests in flight, and by one more at concurrency 1 on the first MT-Bench prompts: the speedup one user sees.
Under `--scale auto` the data is sized from a timed forward of the target, the rows fill the minutes left of the
hour. Every stage is the real CLI in a subprocess and resumes: a re-run does only what is missing. Writes
DIR/compare.json, the doc (`--doc`) and the raw output (both evaluate reports and their terminal tables) under
bench/results/compare-HOST-DATE/.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from compare_report import render_doc, results_dir_name, summarize
from compare_settings import (
    BASE,
    BUDGET_MIN,
    CALIBRATION_STEPS,
    DEFAULT_DIR,
    DEFAULT_DOC,
    DEFAULT_ROWS,
    DEPTHS,
    EVAL_CONCURRENCY,
    RESULTS_DIR,
    ROWS,
    CompareError,
    eval_minutes,
    median_step_s,
    package_choices,
    row_flags,
    row_steps,
    say,
    scale_for,
    timed_as,
    trainable,
)
from quality import extract, flags, generate, write_sources
from quality_settings import MODEL, REPO, SAMPLED, SHAREGPT, VENV_PY, VLLM_PY, QualityError, write_atomic
from quality_sizing import bf16_units, compute_dtype_line, parse_scale, probe


def cli(python: Path, *args: str, log: Path | None = None) -> None:
    """`peagle-pipeline ARGS` with `python`; its output goes to the terminal (and to `log` when given)."""
    cmd = [str(python), "-m", "peagle_pipeline.cli", *args]
    if log is None:
        code = subprocess.run(cmd, cwd=REPO).returncode
    else:
        with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) as proc, log.open("w") as f:
            for line in proc.stdout or []:
                sys.stdout.write(line)
                f.write(line)
        code = proc.returncode
    if code != 0:
        raise CompareError(f"`peagle-pipeline {args[0]}` failed with exit code {code}", code)


def calibrate(root: Path, name: str, cache: Path, choices: dict[str, list[str]]) -> float:
    """Seconds per training step of row `name` on `cache`: the median of a short run (kept in DIR/calibrate)."""
    run = root / "calibrate" / name
    if median_step_s(run) is None:
        shutil.rmtree(run, ignore_errors=True)
        opts = {**row_flags(name, choices), "steps": CALIBRATION_STEPS, "log_every": 2, "warmup": 2}
        opts.update(eval_every=CALIBRATION_STEPS, save_every=CALIBRATION_STEPS, eval_samples=4, export=False)
        cli(VENV_PY, "train", *flags(cache=cache, output=run, **opts))
    step_s = median_step_s(run)
    if step_s is None:
        raise CompareError(f"no step times in {run / 'metrics.jsonl'}", 1)
    return step_s


def train_row(root: Path, name: str, cache: Path, steps: int, choices: dict[str, list[str]]) -> Path:
    """Train (or finish) one row; its export is RUN/export, its checkpoints are dropped once it is there."""
    run = root / "runs" / name
    if not (run / "export" / "config.json").exists():
        opts = {
            **row_flags(name, choices),
            "steps": steps,
            "eval_every": max(steps // 4, 1),
            "save_every": steps,
        }
        resume = ["--resume"] if (run / "train.yaml").exists() else []
        cli(VENV_PY, "train", *flags(cache=cache, output=run, **opts), *resume)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    return run


def evaluate(root: Path, name: str, exports: list[Path], s: dict[str, Any], speed: bool) -> dict[str, Any]:
    """One `evaluate` run of every export: MT-Bench and HumanEval at 16 in flight, or (`speed`) the first
    MT-Bench prompts one at a time; its table is kept beside its report (DIR/eval/NAME/table.txt)."""
    out = root / "eval" / name
    report = out / "report.json"
    if not report.exists():
        out.mkdir(parents=True, exist_ok=True)
        if speed:
            sets = flags(prompts="mt-bench", num_prompts=s["speed_prompts"])
        else:
            sets = flags(prompts=["mt-bench", "humaneval"], num_prompts=s["humaneval_prompts"])
            sets += flags(concurrency=EVAL_CONCURRENCY, acceptance_concurrency=EVAL_CONCURRENCY)
        cli(
            VLLM_PY,
            "evaluate",
            *map(str, exports),
            *flags(target=MODEL, max_tokens=s["eval_max_tokens"], temperature=0, depths=DEPTHS, output=out),
            *sets,
            log=out / "table.txt",
        )
    return json.loads(report.read_text())


def keep_raw(root: Path, summary: dict[str, Any]) -> Path:
    """Copy what the doc's figures come from (compare.json, both evaluate reports, gzipped, and tables, the times) to
    bench/results/compare-HOST-DATE/."""
    dest = REPO / RESULTS_DIR / results_dir_name(summary)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("all", "speed"):  # the reports gzipped (a tenth of the bytes; `zcat` reads them)
        src = root / "eval" / name
        if (src / "report.json").exists():
            (dest / f"{name}-report.json.gz").write_bytes(
                gzip.compress((src / "report.json").read_bytes(), 9)
            )
        if (src / "table.txt").exists():
            shutil.copy2(src / "table.txt", dest / f"{name}-table.txt")
    for file in ("compare.json", "times.json", "sizing.json"):
        if (root / file).exists():
            shutil.copy2(root / file, dest / file)
    return dest


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", default=DEFAULT_DIR, help="working directory (data, cache, runs, reports)")
    ap.add_argument(
        "--scale", default="auto", help="multiply the data (0.2 = a smoke run); auto: sized to this host"
    )
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"rows to run, of {', '.join(ROWS)}")
    ap.add_argument("--minutes", type=float, default=BUDGET_MIN, help="the whole run's budget in minutes")
    ap.add_argument("--doc", default=DEFAULT_DOC, help="where to write the report (markdown)")
    ap.add_argument("--render", action="store_true", help="only re-write the doc from DIR/compare.json")
    return ap.parse_args()


def _rows(text: str) -> list[str]:
    rows = [r for r in text.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        raise CompareError(
            f"--rows: unknown row(s) {', '.join(unknown) or '(none given)'}; rows are {', '.join(ROWS)}", 2
        )
    return rows


class Timer:
    """Stage times, kept in DIR/times.json so that a re-run after an interruption reports the time of all the work."""

    def __init__(self, root: Path) -> None:
        self.path = root / "times.json"
        self.times: dict[str, float] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def __call__(self, label: str, fn: Any, *a: Any) -> Any:
        say(label)
        start = time.time()
        out = fn(*a)
        self.times[label] = self.times.get(label, 0.0) + time.time() - start
        write_atomic(self.path, json.dumps(self.times, indent=2) + "\n")
        return out


def _plan(
    root: Path, step_s: dict[str, float], s: dict, sizing: dict, spent_s: float, minutes: float
) -> dict:
    """Every row's steps at equal training time (`row_steps`), kept in DIR/plan.json: a re-run keeps the first."""
    path = root / "plan.json"
    if not path.exists():
        eval_min = eval_minutes(len(step_s), s, sizing["probe_tokens_per_s"])
        plan = {**row_steps(step_s, spent_s, eval_min, minutes), "eval_predicted_min": eval_min}
        write_atomic(path, json.dumps(plan, indent=2) + "\n")
    plan = json.loads(path.read_text())
    say(
        f"every row trains {plan['train_s_per_row'] / 60:.1f} min: "
        + ", ".join(f"{k} {v:,} steps" for k, v in plan["steps"].items())
    )
    return dict(plan)


def _publish(root: Path, doc: Path, summary: dict[str, Any]) -> None:
    """DIR/compare.json, the raw output under bench/results/ and the doc."""
    write_atomic(root / "compare.json", json.dumps(summary, indent=2) + "\n")
    dest = keep_raw(root, summary)
    summary["raw_output"] = str(dest.relative_to(REPO))
    write_atomic(root / "compare.json", json.dumps(summary, indent=2) + "\n")
    shutil.copy2(root / "compare.json", dest / "compare.json")
    doc.write_text(render_doc(summary, doc))
    say(f"wrote {doc}, {root / 'compare.json'} and {dest} in {summary['total_s'] / 60:.1f} min")


def run(root: Path, args: argparse.Namespace, rows: list[str], choices: dict, skipped: list[str]) -> dict:
    """Every stage (each resumes): data, cache, calibration, the rows' training, both evaluations; the summary."""
    root.mkdir(parents=True, exist_ok=True)
    timed = Timer(root)
    sizing = _sizing(root, args, timed)
    s = {**BASE, "source_conversations": max(int(BASE["source_conversations"] * sizing["scale"]), 8)}
    sources, _, _ = write_sources(root, s["source_conversations"], 0, 1)
    data = timed(
        "generate: on-policy multi-turn, sampled", generate, root, "multi-sampled", sources, SAMPLED, "all", s
    )
    cache = timed("extract: on-policy multi-turn", extract, root, "on-multi", data, s["max_length"])
    timed_rows = {timed_as(name, rows) for name in rows}  # a noise row trains its base row's steps
    own_s = {name: timed(f"calibrate: {name}", calibrate, root, name, cache, choices) for name in timed_rows}
    step_s = {name: own_s[timed_as(name, rows)] for name in rows}
    plan = _plan(root, step_s, s, sizing, sum(timed.times.values()), args.minutes)
    runs = {
        name: timed(f"train: {name}", train_row, root, name, cache, plan["steps"][name], choices)
        for name in rows
    }
    exports = [r / "export" for r in runs.values()]
    report = timed("evaluate: every row on MT-Bench and HumanEval", evaluate, root, "all", exports, s, False)
    speed = timed("evaluate: every row at concurrency 1", evaluate, root, "speed", exports, s, True)
    host = {
        "hardware": report.get("hardware"),
        "bf16_units": bf16_units(),
        "compute_dtype": compute_dtype_line(),
    }
    settings = {**s, "sizing": sizing, "skipped": skipped, **host}
    return summarize(runs, report, speed, plan, timed.times, settings)


def main() -> int:
    args = _args()
    root, doc = (REPO / args.dir).resolve(), (REPO / args.doc).resolve()
    if args.render:
        if not (root / "compare.json").exists():
            raise CompareError(f"{root / 'compare.json'} is missing: run `make compare` first", 2)
        doc.write_text(render_doc(json.loads((root / "compare.json").read_text()), doc))
        say(f"wrote {doc} from {root / 'compare.json'}")
        return 0
    for need in (VENV_PY, VLLM_PY, MODEL, SHAREGPT):
        if not need.exists():
            raise CompareError(
                f"{need} is missing: run `make compare` (it installs and prepares everything)", 2
            )
    choices = package_choices()
    rows, skipped = trainable(_rows(args.rows), choices)
    for line in skipped:
        say(line)
    if not rows:
        raise CompareError("no row can run with this package", 2)
    _publish(root, doc, run(root, args, rows, choices, skipped))
    return 0


def _sizing(root: Path, args: argparse.Namespace, timed: Any) -> dict[str, Any]:
    """The data's scale: `--scale`, or from a timed forward of the target (kept in DIR/sizing.json)."""
    path = root / "sizing.json"
    if path.exists():
        return json.loads(path.read_text())
    scale = parse_scale(args.scale)
    tokens_per_s = timed("size: time the target's forward", probe)
    sizing = {
        "scale": scale if scale is not None else scale_for(tokens_per_s),
        "probe_tokens_per_s": tokens_per_s,
    }
    sizing["auto"] = scale is None
    write_atomic(path, json.dumps(sizing, indent=2) + "\n")
    return sizing


if __name__ == "__main__":
    try:
        sys.exit(main())
    except QualityError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.code)
