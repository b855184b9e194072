"""`make quality`: what on-policy data does to acceptance, measured in vLLM, on this machine class (CPU).

    python experiments/quality.py --dir .quality [--scale auto|FACTOR] [--doc docs/results/quality.md] [--render]

SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) with ShareGPT prompts. Every row of the ablation is trained at the same
budget (steps x tokens_per_step) and measured by `peagle-pipeline evaluate` in vLLM on MT-Bench (80 first turns)
and on held-out ShareGPT prompts (records >= 17,000, never trained on), K = 4, T = 0:

    data        off-policy (ShareGPT's own replies) | on-policy multi-turn (every reply regenerated, sampled)
    curve       the main draft: both caches of the run (on- and off-policy), trained longer; AL against training
                tokens (vLLM at checkpoints, trainer estimate)
    speed       the main draft at concurrency 1 (the headline setting): AL and tokens/s with and without it

The run is sized to an hour on the host it runs on (`--scale auto`: a timed forward of the target picks the factor for
the data and the ablation's steps, the main run's steps fill the minutes left after them; the evaluation does not
scale). docs/results/quality.md gives each stage's time;
docs/results/what-we-learned.md says where the time goes and how hosts of this class differ. `--render` re-writes the
doc from DIR/quality.json alone; QUALITY_DIR and QUALITY_DOC (make) put a second run beside the first.

Every stage is the real CLI in a subprocess (`generate` and `evaluate` in .venv-vllm, `extract` and `train` in .venv),
and every stage resumes, so a re-run only does what is missing. Writes DIR/quality.json (every figure), DIR/*.png and
the doc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from quality_report import (
    draft_row,
    estimate_curve,
    fit_log_curve,
    plot,
    render_doc,
    results_by_draft,
    speed_figures,
)
from quality_settings import (
    BASE,
    BUDGET_MIN,
    CARRIER,
    DEFAULT_DIR,
    DEFAULT_DOC,
    EVAL_CONCURRENCY,
    EVALS_PER_RUN,
    HELDOUT_FIRST_RECORD,
    MAIN_EXTRA,
    MODEL,
    REPO,
    SAMPLED,
    SHAREGPT,
    TRAIN,
    VENV_PY,
    VLLM_PY,
    QualityError,
    say,
    write_atomic,
)
from quality_sizing import auto_scale, bf16_units, compute_dtype_line, parse_scale, size_main_run


def cli(python: Path, *args: str) -> None:
    """Run `peagle-pipeline ARGS` with `python`; its progress goes to the terminal."""
    cmd = [str(python), "-m", "peagle_pipeline.cli", *args]
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode != 0:
        raise QualityError(
            f"`peagle-pipeline {args[0]}` failed with exit code {proc.returncode}", proc.returncode
        )


def flags(**opts: Any) -> list[str]:
    out: list[str] = []
    for name, value in opts.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, list | tuple):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


# --------------------------------------------------------------------------------------------------- data
def write_sources(root: Path, n_train: int, n_more: int, n_heldout: int) -> tuple[Path, Path, Path]:
    """The first `n_train` ShareGPT records (training sources), the next `n_more` (the second off-policy cache's)
    and the first `n_heldout` first user turns of records >= 17,000 (held-out prompts)."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, more, heldout = (
        data / "train_sources.jsonl",
        data / "more_sources.jsonl",
        data / "heldout_prompts.jsonl",
    )
    if train.exists() and more.exists() and heldout.exists():
        return train, more, heldout
    with open(SHAREGPT, encoding="utf-8") as f:
        lines = f.readlines()
    if n_train + n_more > HELDOUT_FIRST_RECORD:
        raise QualityError(f"{n_train + n_more} training records would reach the held-out records", 2)
    write_atomic(train, "".join(lines[:n_train]))
    write_atomic(more, "".join(lines[n_train : n_train + n_more]))
    prompts = []
    for line in lines[HELDOUT_FIRST_RECORD:]:
        turns = json.loads(line).get("conversations") or []
        if turns and turns[0].get("from") in ("human", "user") and 0 < len(turns[0]["value"]) <= 2000:
            prompts.append(json.dumps({"prompt": turns[0]["value"]}) + "\n")
        if len(prompts) == n_heldout:
            break
    write_atomic(heldout, "".join(prompts))
    return train, more, heldout


def generate(root: Path, name: str, sources: Path, sampling: dict[str, Any], turns: str, s: dict) -> Path:
    out = root / "onpolicy" / name
    cli(
        VLLM_PY,
        "generate",
        *flags(
            model=MODEL,
            data=sources,
            output=out,
            backend="vllm",
            turns=turns,
            max_new_tokens=s["max_new_tokens"],
            # A reply that starts past the cut leaves nothing in the cache: the conversation ends there.
            max_prompt_tokens=s["max_length"],
            seed=0,
            chunk_size=s["generate_chunk"],
            **sampling,
        ),
    )
    return out


def extract(root: Path, name: str, data: Path, max_length: int) -> Path:
    """Extract (or finish) one cache, each sample cut to its first `max_length` tokens."""
    out = root / "caches" / name
    cli(
        VENV_PY,
        "extract",
        *flags(data=data, model=MODEL, output=out, topk=32, max_length=max_length, batch_tokens=4096),
    )
    return out


# -------------------------------------------------------------------------------------------------- train
def train(
    root: Path,
    name: str,
    cache: Path,
    steps: int,
    save_every: int | None = None,
    evals: int = EVALS_PER_RUN,
    **over: Any,
) -> Path:
    """Train (or finish) one row, with `evals` held-out estimates (at every 1/`evals` of `save_every` when given, so
    each saved checkpoint has one); returns its run directory (export: RUN/export)."""
    run = root / "runs" / name
    if (run / "export" / "config.json").exists():
        return run
    opts = {**TRAIN, **over, "steps": steps, "eval_every": max((save_every or steps) // evals, 1)}
    opts["save_every"] = save_every or steps
    opts["keep_checkpoints"] = 100
    resume = ["--resume"] if (run / "train.yaml").exists() else []
    cli(VENV_PY, "train", *flags(cache=cache, output=run, **opts), *resume)
    if save_every is None:
        drop_checkpoints(run)  # the export is all the report needs
    return run


def drop_checkpoints(run: Path) -> None:
    """Delete a finished run's checkpoints (weights and optimizer state: ~19 GB over all rows otherwise, which
    once filled the disk); the exports the report measures stay."""
    if (run / "export" / "config.json").exists():
        shutil.rmtree(run / "checkpoints", ignore_errors=True)


def export_checkpoint(run: Path, step: int) -> Path:
    out = run / f"export-step-{step}"
    if not (out / "config.json").exists():
        cli(VENV_PY, "export", str(run), *flags(output=out, checkpoint=f"step-{step}"))
    return out


def evaluate(root: Path, name: str, drafts: list[Path], heldout: Path, s: dict) -> dict[str, Any]:
    """One `evaluate` run: the drafts side by side on MT-Bench and the held-out prompts."""
    out = root / "eval" / name
    report = out / "report.json"
    if not report.exists():
        cli(
            VLLM_PY,
            "evaluate",
            *map(str, drafts),
            *flags(target=MODEL, prompts="mt-bench"),
            *flags(prompts=heldout, num_prompts=s["mtbench_prompts"], max_tokens=s["eval_max_tokens"]),
            *flags(temperature=0, depths=TRAIN["depths"], output=out),
            *flags(concurrency=EVAL_CONCURRENCY, acceptance_concurrency=EVAL_CONCURRENCY),
        )
    return json.loads(report.read_text())


def evaluate_speed(root: Path, export: Path, s: dict, name: str = "speed") -> dict[str, Any]:
    """A main draft at concurrency 1 (one user: the headline AL setting) on MT-Bench: AL, tokens/s with and without."""
    out = root / "eval" / name
    report = out / "report.json"
    if not report.exists():
        cli(
            VLLM_PY,
            "evaluate",
            str(export),
            *flags(target=MODEL, prompts="mt-bench", num_prompts=s["speed_prompts"]),
            *flags(max_tokens=s["eval_max_tokens"], temperature=0, depths=TRAIN["depths"], output=out),
        )
    return json.loads(report.read_text())


# --------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=DEFAULT_DIR, help="working directory (data, caches, runs, reports)")
    ap.add_argument(
        "--scale",
        default="auto",
        help="multiply data and step budgets (0.2 = a smoke run); auto: the factor that fits "
        f"{BUDGET_MIN:.0f} minutes on this host, from a timed forward of the target",
    )
    ap.add_argument("--doc", default=DEFAULT_DOC, help="where to write the report (markdown)")
    ap.add_argument(
        "--render", action="store_true", help="only re-write the doc and its chart from DIR/quality.json"
    )
    args = ap.parse_args()
    root = (REPO / args.dir).resolve()
    doc = (REPO / args.doc).resolve()
    if args.render:
        if not (root / "quality.json").exists():
            raise QualityError(f"{root / 'quality.json'} is missing: run `make quality` first", 2)
        summary = json.loads((root / "quality.json").read_text())
        plot(summary, root, doc)
        doc.write_text(render_doc(summary, root, doc))
        say(f"wrote {doc} from {root / 'quality.json'}")
        return 0
    for need in (VENV_PY, VLLM_PY, MODEL, SHAREGPT):
        if not need.exists():
            raise QualityError(
                f"{need} is missing: run `make quality` (it installs and prepares everything)", 2
            )
    # Stage times persist in DIR/times.json, so an interrupted and re-run `make quality` reports the time of all
    # the work (a stage that was complete adds only the seconds it took to notice that).
    times_file = root / "times.json"
    times: dict[str, float] = json.loads(times_file.read_text()) if times_file.exists() else {}

    def timed(label: str, fn: Any, *a: Any, **k: Any) -> Any:
        say(label)
        start = time.time()
        out = fn(*a, **k)
        times[label] = times.get(label, 0.0) + time.time() - start
        write_atomic(times_file, json.dumps(times, indent=2) + "\n")
        return out

    scale = parse_scale(args.scale)
    sizing: dict[str, Any] = {"scale": scale, "budget_min": None}
    if scale is None:
        sizing = {**timed("size: time the target's forward", auto_scale, root), "budget_min": BUDGET_MIN}
        scale = sizing["scale"]
        say(
            f"target forward {sizing['probe_tokens_per_s']:.0f} tokens/s here: data and ablation steps x {scale}; "
            f"the main run gets what is left of the {BUDGET_MIN:.0f} minutes"
        )
    s = dict(BASE)
    s["scale"] = scale
    # The held-out and MT-Bench prompt counts stay: the measurement is the same at every scale.
    for key in ("source_conversations", "more_conversations", "ablation_steps", "main_steps"):
        s[key] = max(int(BASE[key] * scale), 8)
    # Every curve point needs its own trainer estimate: main steps a multiple of curve points x estimates per point.
    per_run = s["curve_points"] * EVALS_PER_RUN
    s["main_steps"] = max(s["main_steps"] // per_run, 1) * per_run
    # Data: the same source conversations, with their original replies or regenerated by the target.
    sources, more_sources, heldout = write_sources(
        root, s["source_conversations"], s["more_conversations"], s["heldout_prompts"]
    )
    multi = timed(
        "generate: on-policy multi-turn, sampled", generate, root, "multi-sampled", sources, SAMPLED, "all", s
    )
    cut = s["max_length"]
    caches = {
        "off-policy": timed("extract: off-policy", extract, root, "off-policy", sources, cut),
        "on-multi": timed("extract: on-policy multi-turn", extract, root, "on-multi", multi, cut),
    }
    main_only = {
        "off-policy-more": timed(
            "extract: off-policy, the next records", extract, root, "off-policy-more", more_sources, cut
        )
    }
    # Ablation at equal budget: the data rows. Settled questions left the run to keep it within the hour on a slower
    # host (their figures: docs/results/what-we-learned.md): the mask token (<|im_end|> against the default rule's unused token,
    # +0.004), the loss on the replies only (-0.035 MT-Bench AL), greedy regeneration (-0.009 and -0.002 MT-Bench AL
    # against sampled in the last two runs), a second draft layer (-0.002 and -0.010 at equal steps) and single-turn
    # regeneration (-0.006 and +0.004 MT-Bench AL against multi-turn in the last two runs, from a second extraction
    # of the multi-turn cache's first turns); the time they took buys more data and steps for every row.
    steps = s["ablation_steps"]
    rows: dict[str, Path] = {}
    for name, cache in caches.items():
        rows[name] = timed(f"train: {name}", train, root, name, cache, steps)
    # The learning curve: the carrier data trained longer, exported at evenly spaced checkpoints. Under `auto` its
    # steps fill the minutes left (quality_sizing.size_main_run); under `--scale` they are BASE's, scaled.
    if sizing.get("budget_min"):
        sizing["main"] = size_main_run(root, sizing, sum(times.values()), list(rows.values()), per_run)
        s["main_steps"] = sizing["main"]["steps"]
        say(
            f"main run: {s['main_steps']:,} steps in the {sizing['main']['left_min']:.1f} minutes left "
            f"({sizing['main']['step_s']:.3f} s a step in the ablation rows)"
        )
    main_steps = s["main_steps"]
    every = max(main_steps // s["curve_points"], 1)
    main_run = timed(
        "train: main run (learning curve)",
        train,
        root,
        "main",
        caches[CARRIER],
        main_steps,
        every,
        extra_cache=[str({**caches, **main_only}[name]) for name in MAIN_EXTRA],
    )
    curve_steps = [every * i for i in range(1, s["curve_points"] + 1) if every * i <= main_steps]
    curve_exports = timed(
        "export: the curve's checkpoints", lambda: [export_checkpoint(main_run, st) for st in curve_steps]
    )
    drop_checkpoints(main_run)
    # Every draft in one `evaluate` run: one engine setting, one plain-target baseline, the same prompts.
    report = timed(
        "evaluate: every row and curve point",
        evaluate,
        root,
        "all",
        [*(r / "export" for r in rows.values()), *curve_exports],
        heldout,
        s,
    )
    results = results_by_draft(report)
    speed = timed("evaluate: main draft at concurrency 1", evaluate_speed, root, main_run / "export", s)
    summary = {
        "settings": {
            **s,
            "train": TRAIN,
            "sampled": SAMPLED,
            "carrier": CARRIER,
            "main_extra": list(MAIN_EXTRA),
        },
        "sizing": sizing,
        "host": report.get("hardware"),
        "bf16_units": bf16_units(),
        "compute_dtype": compute_dtype_line(),
        "cpu_bf16_env": os.environ.get("PEAGLE_CPU_BF16"),
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "total_s": round(sum(times.values()), 1),
        "rows": [draft_row(name, run, results, run / "export", steps) for name, run in rows.items()],
        "curve": [
            draft_row(f"main @ {st} steps", main_run, results, exp, st)
            for st, exp in zip(curve_steps, curve_exports, strict=True)
        ],
        "estimate_curve": estimate_curve(main_run),
        "speed": speed_figures(speed),
        "eval_dtype": report.get("dtype"),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    summary["curve_fit"] = fit_log_curve([(c["train_tokens"], c["mtbench_al"]) for c in summary["curve"]])
    summary["estimate_fit"] = fit_log_curve(summary["estimate_curve"])
    (root / "quality.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, root, doc)
    doc.write_text(render_doc(summary, root, doc))
    say(f"wrote {doc} and {root / 'quality.json'} in {summary['total_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except QualityError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.code)
