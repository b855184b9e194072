"""The CPU demo end to end (`make demo`): generate on-policy replies, extract, inspect, train, export, plot, and
vLLM's acceptance length on MT-Bench, then a summary.

    python scripts/demo.py --dir .demo [--config pipelines/smollm2-sharegpt.yaml] [--vllm/--no-vllm]

Every stage runs the real CLI as a subprocess (`python -m peagle_pipeline.cli ...`) with the pipeline file's
`generate:` / `extract:` / `train:` sections; paths are taken from --dir (DIR/models/SmolLM2-135M-Instruct,
DIR/data/sharegpt.jsonl, DIR/onpolicy, DIR/cache, DIR/run, DIR/export, DIR/eval). `generate` and `evaluate` run in
.venv-vllm (vLLM); without it the demo generates with transformers (slow) and skips the measurement. Re-running is
cheap: generation and extraction resume or are no-ops, a finished training run is reused (a partial one continues
with --resume), and the evaluation is skipped when its report matches the export.
The stages print their own progress; this script prints the stage headers and, at the end, a summary table that it
also writes to DIR/summary.md. Timings of earlier runs are kept in DIR/demo_state.json. A failing stage stops the
demo with a one-line error and its exit code. The summary never invents a number: what was not measured says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL_NAME = "SmolLM2-135M-Instruct"
STATE_FILE = "demo_state.json"
SUMMARY_FILE = "summary.md"
EVAL_DIR = "eval"  # `evaluate --output`: report.json and acceptance.png
MTBENCH_PROMPTS = 80
EVAL_MAX_TOKENS = 64
EVAL_CONCURRENCY = 16  # requests in flight in the AL run (the same AL, several times faster on a CPU)
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"


class DemoError(Exception):
    """The demo cannot go on: a one-line message and the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class StageFailed(DemoError):
    """A stage's subprocess exited non-zero (its own one-line error is already on stderr)."""

    def __init__(self, stage: str, code: int) -> None:
        super().__init__(
            f"demo stopped: `{stage}` failed with exit code {code} (its error is printed above)", code
        )


# ------------------------------------------------------------------------------------------------ helpers
def header(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def cli(*args: str, python: str | os.PathLike[str] = sys.executable, capture: bool = False) -> str:
    """Run `peagle-pipeline ARGS` as a subprocess; stderr (progress bars) always goes to the terminal.

    With capture=True stdout is returned (and echoed); otherwise it goes to the terminal too.
    """
    cmd = [str(python), "-m", "peagle_pipeline.cli", *args]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE if capture else None, text=True)
    out = proc.stdout or ""
    if capture and out:
        print(out, end="" if out.endswith("\n") else "\n", flush=True)
    if proc.returncode != 0:
        raise StageFailed(f"peagle-pipeline {args[0]}", proc.returncode)
    return out


def load_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ stages
def generate(cfg_path: Path, paths: dict[str, Path], state: dict[str, Any]) -> None:
    """Regenerate the replies with the target (on-policy data); resumes, a no-op when complete."""
    python = VLLM_PY if VLLM_PY.exists() else Path(sys.executable)
    how = "vLLM" if VLLM_PY.exists() else "transformers (no .venv-vllm: slow; `make setup-vllm`)"
    header(f"1/8 generate: the target writes its own replies to the ShareGPT prompts, with {how}")
    t0 = time.perf_counter()
    out = cli(
        "generate",
        "--config",
        str(cfg_path),
        "--model",
        str(paths["model"]),
        "--data",
        str(paths["data"]),
        "--output",
        str(paths["onpolicy"]),
        python=python,
        capture=True,
    )
    if "already complete" not in out:
        gen = state.setdefault("generate", {"seconds": 0.0, "runs": 0})
        gen["seconds"] += time.perf_counter() - t0
        gen["runs"] += 1
        ours = [
            ln.strip() for ln in out.splitlines() if ln.strip() and not ln.startswith("(")
        ]  # not vLLM's logs
        gen["summary"] = ours[-4:]


def extract(cfg_path: Path, paths: dict[str, Path], state: dict[str, Any]) -> None:
    """Extract (or resume, or no-op) the cache; accumulate the time and tokens of the runs that did work."""
    header("2/8 extract: run the target once over its own replies (resumes; no-op when complete)")
    out = cli(
        "extract",
        "--config",
        str(cfg_path),
        "--model",
        str(paths["model"]),
        "--data",
        str(paths["onpolicy"]),
        "--output",
        str(paths["cache"]),
        capture=True,
    )
    m = re.search(r"(\d+) new tokens in ([\d.]+) s", out)
    if m and int(m.group(1)) > 0:
        ex = state.setdefault("extract", {"seconds": 0.0, "tokens": 0, "runs": 0})
        ex["seconds"] += float(m.group(2))
        ex["tokens"] += int(m.group(1))
        ex["runs"] += 1
        ex["load_avg"] = round(os.getloadavg()[1], 1)  # 5-minute average over the run's end


def train_status(cfg_path: Path, paths: dict[str, Path]) -> tuple[str, int | None]:
    """('fresh' | 'resume' | 'complete', planned steps) of the run directory."""
    from peagle_pipeline.config import TrainConfig, resolve
    from peagle_pipeline.stages.checkpoint import CHECKPOINTS_DIR

    cfg = resolve(TrainConfig, cfg_path, {"cache": str(paths["cache"]), "output": str(paths["run"])})
    run = paths["run"]
    if not (run / "train.yaml").is_file():
        return "fresh", cfg.steps
    steps = [
        int(p.name.split("-")[1]) for p in (run / CHECKPOINTS_DIR).glob("step-*") if p.name[5:].isdigit()
    ]
    done = max(steps, default=0)
    if cfg.steps is not None:
        return ("complete" if done >= cfg.steps else "resume"), cfg.steps
    return ("complete" if (run / "export" / "config.json").is_file() else "resume"), None


def train(cfg_path: Path, paths: dict[str, Path], state: dict[str, Any]) -> None:
    status, steps = train_status(cfg_path, paths)
    base = ["train", "--config", str(cfg_path), "--cache", str(paths["cache"]), "--output", str(paths["run"])]
    if status == "complete":
        header(
            f"4/8 train: the run in {paths['run']} is complete ({steps} steps): reused (delete it to retrain)"
        )
        return
    what = "continue the partial run (--resume)" if status == "resume" else "a new run"
    header(f"4/8 train: {what} from the cache only (the target model is never loaded)")
    t0 = time.perf_counter()
    cli(*base, *(["--resume"] if status == "resume" else []))
    tr = state.setdefault("train", {"seconds": 0.0, "runs": 0})
    tr["seconds"] += time.perf_counter() - t0
    tr["runs"] += 1
    tr["load_avg"] = round(os.getloadavg()[2], 1)  # 15-minute average over the run


def evaluate(paths: dict[str, Path], state: dict[str, Any], wanted: bool | None) -> dict[str, Any] | None:
    """vLLM's acceptance length on MT-Bench (`evaluate` in .venv-vllm); reused when its report matches the export.

    Returns the MT-Bench row of the report (see docs/guides/evaluate.md), or None when skipped.
    """
    if wanted is False:
        header("8/8 evaluate: skipped (--no-vllm)")
        state["vllm_skipped"] = "--no-vllm"
        return None
    if not VLLM_PY.exists():
        if wanted:
            raise DemoError("--vllm given but .venv-vllm does not exist: run `make setup-vllm` first", 2)
        header("8/8 evaluate: skipped (no .venv-vllm; `make setup-vllm` enables it)")
        state["vllm_skipped"] = "no .venv-vllm"
        return None
    state.pop("vllm_skipped", None)
    out = paths["eval"]
    report = out / "report.json"
    sha = file_sha(paths["export"] / "model.safetensors")
    if report.is_file() and state.get("eval_export_sha") == sha:
        header("8/8 evaluate: the report in place matches this export: reused")
        from peagle_pipeline.stages.evaluate.card_table import refresh_cards

        saved = json.loads(report.read_text())  # the export step rewrote the card: its measured part again
        refresh_cards(saved, {d["name"]: str(paths["export"]) for d in saved["drafts"]}, print)
    else:
        header(
            f"8/8 evaluate: target + draft in vLLM (parallel drafting) on {MTBENCH_PROMPTS} MT-Bench prompts, "
            "T = 0, with and without the draft"
        )
        report.unlink(missing_ok=True)
        cli(
            "evaluate",
            str(paths["export"]),
            "--target",
            str(paths["model"]),
            "--prompts",
            "mt-bench",
            "--num-prompts",
            str(MTBENCH_PROMPTS),
            "--max-tokens",
            str(EVAL_MAX_TOKENS),
            "--concurrency",
            str(EVAL_CONCURRENCY),
            "--acceptance-concurrency",
            str(EVAL_CONCURRENCY),
            "--output",
            str(out),
            python=VLLM_PY,
        )
        state["eval_export_sha"] = sha
    (row,) = [r for r in json.loads(report.read_text())["results"] if r["prompt_set"] == "mt-bench"]
    return row


# ------------------------------------------------------------------------------------------------ summary
def final_eval(run: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None, float, float]:
    """(last eval record, last train record, summed step seconds, tokens trained) from the run's metrics.jsonl."""
    from peagle_pipeline.stages.train.metrics import read_metrics

    records = read_metrics(run)
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    step_time, tokens, prev = 0.0, 0.0, 0
    for r in trains:
        seconds = (int(r["step"]) - prev) * float(r.get("step_time", 0.0))
        step_time += seconds
        tokens += seconds * float(r.get("tokens_per_s", 0.0))
        prev = int(r["step"])
    return (evals[-1] if evals else None), (trains[-1] if trains else None), step_time, tokens


def summary(paths: dict[str, Path], state: dict[str, Any], vllm: dict[str, Any] | None, load0: float) -> str:
    from peagle_pipeline.cache import layout
    from peagle_pipeline.cache.reader import open_cache

    cache = open_cache(paths["cache"])
    tokens = int(cache.samples["length"].sum())
    supervised = int(cache.samples["num_supervised"].sum())
    store_bytes = dir_bytes(paths["cache"] / layout.STORES_DIR)
    ev, last_train, step_time, trained = final_eval(paths["run"])
    ex, tr = state.get("extract"), state.get("train")
    rows: list[tuple[str, str]] = [
        (
            "machine",
            f"{os.cpu_count()} CPU cores; load average {load0:.1f} at the start of this `make demo`, "
            f"{os.getloadavg()[0]:.1f} at its end",
        ),
        ("conversations", f"{len(cache.samples)} samples extracted, {len(cache.rejects)} rejected"),
        ("tokens extracted", f"{tokens:,} ({supervised:,} supervised, {supervised / max(tokens, 1):.0%})"),
        (
            "cache size",
            f"{dir_bytes(paths['cache']) / 1e6:.1f} MB on disk: {store_bytes / 1e6:.1f} MB of Zarr stores, "
            "the rest the target pieces (embeddings, lm_head, norm, last layer, tokenizer)",
        ),
        ("bytes per token", f"{store_bytes / max(tokens, 1):,.0f}"),
    ]
    gen = state.get("generate")
    rows.append(
        (
            "on-policy generation",
            f"{gen['seconds'] / 60:.1f} min in {gen['runs']} run(s): " + "; ".join(gen.get("summary", []))
            if gen
            else "not timed (the replies were generated before this demo kept its state)",
        )
    )
    if ex and ex.get("tokens"):
        rows.append(
            (
                "extraction",
                f"{ex['seconds'] / 60:.1f} min, {ex['tokens'] / ex['seconds']:.0f} tokens/s "
                f"({ex['tokens']:,} tokens computed in {ex['runs']} run(s) of this demo"
                + (f"; load average {ex['load_avg']}" if "load_avg" in ex else "")
                + ")",
            )
        )
    else:
        rows.append(("extraction", "not timed (the cache was built before this demo kept its state)"))
    steps = last_train["step"] if last_train else 0
    if tr:
        rows.append(
            (
                "training",
                f"{tr['seconds'] / 60:.1f} min wall in {tr['runs']} run(s), {steps} steps "
                f"({step_time / 60:.1f} min in steps, {trained / max(step_time, 1e-9):.0f} tokens/s on average"
                + (f"; load average {tr['load_avg']}" if "load_avg" in tr else "")
                + ")"
                if last_train
                else f"{tr['seconds'] / 60:.1f} min",
            )
        )
    else:
        rows.append(
            ("training", f"{steps} steps, {step_time / 60:.1f} min in steps (wall time not recorded)")
        )
    if ev:
        agree = ", ".join(
            f"d{d} {a:.2f}" if a is not None else f"d{d} -" for d, a in enumerate(ev["agreement"])
        )
        acc = ev.get("acceptance")
        rows += [
            (
                "held-out eval",
                f"step {ev['step']}, {ev.get('eval_elements', '?')} elements, KL loss {ev['loss']:.3f}",
            ),
            ("per-depth top-1 agreement (held-out)", agree),
            (
                "estimated acceptance length (held-out)",
                "-" if acc is None else f"{acc:.3f} tokens per verification",
            ),
        ]
    else:
        rows.append(("held-out eval", "none logged (eval_samples = 0?)"))
    if vllm is not None:
        acc = vllm.get("acceptance_length")
        per = vllm.get("acceptance_per_position") or []
        (tp,) = [t for t in vllm["throughput"] if t["concurrency"] == vllm["concurrency"]]
        rows.append(
            (
                "vLLM acceptance length, MT-Bench",
                f"**{acc:.3f}** ({vllm['prompts']} first turns x {vllm['max_tokens']} new tokens, K={vllm['depths']}, "
                f"T=0, {vllm['concurrency']} requests in flight; per position {', '.join(f'{p:.2f}' for p in per)})"
                if acc is not None
                else "no drafts measured",
            )
        )
        same = (
            "yes"
            if vllm["identical"]
            else f"no, {vllm['mismatched_prompts']} prompts part (bf16 rounding, docs/guides/evaluate.md)"
        )
        rows.append(
            (
                "vLLM tokens/s with / without the draft",
                f"{tp['tokens_per_s']:.1f} / {tp['plain_tokens_per_s']:.1f} (speedup {tp['speedup']:.2f}x on this "
                f"CPU; {vllm['hardware']}); greedy output identical to plain decoding: {same}",
            )
        )
    else:
        rows.append(("vLLM acceptance length, MT-Bench", f"not run ({state.get('vllm_skipped', 'skipped')})"))
    rows += [
        ("plots", str(paths["run"] / "plots")),
        ("export (speculators P-EAGLE format)", str(paths["export"])),
    ]
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dir", default=".demo", help="demo folder (assets from `make demo-assets`, all outputs)"
    )
    ap.add_argument(
        "--config", default=str(REPO / "pipelines" / "smollm2-sharegpt.yaml"), help="pipeline file"
    )
    ap.add_argument(
        "--vllm", dest="vllm", action="store_true", default=None, help="require the vLLM measurement"
    )
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip the vLLM measurement")
    args = ap.parse_args(argv)
    # Paths relative to the repository when inside it (the stages run there): the same strings as the pipeline
    # file's, so a run started with `peagle-pipeline train -c pipelines/smollm2-sharegpt.yaml` resumes here too.
    d = Path(args.dir).resolve()
    if d.is_relative_to(REPO):
        d = d.relative_to(REPO)
    os.chdir(REPO)
    paths = {
        "dir": d,
        "model": d / "models" / MODEL_NAME,
        "data": d / "data" / "sharegpt.jsonl",
        "onpolicy": d / "onpolicy",
        "cache": d / "cache",
        "run": d / "run",
        "export": d / "export",
        "eval": d / EVAL_DIR,
    }
    load0 = os.getloadavg()[0]
    try:
        for key in ("model", "data"):
            if not paths[key].exists():
                raise DemoError(f"{paths[key]} is missing: run `make demo-assets` (or give --dir)", 2)
        state_path = d / STATE_FILE
        state = load_state(state_path)
        for key, folder in (
            ("generate", "onpolicy"),
            ("extract", "cache"),
            ("train", "run"),
        ):  # since deleted
            if not paths[folder].exists():
                state.pop(key, None)
        cfg = Path(args.config)
        try:
            generate(cfg, paths, state)
            save_state(state_path, state)
            extract(cfg, paths, state)
            save_state(state_path, state)
            header("3/8 inspect: the cache's settings and statistics")
            cli("inspect", str(paths["cache"]))
            train(cfg, paths, state)
        except StageFailed as err:
            from peagle_pipeline.errors import ResumeMismatch

            if err.code == ResumeMismatch.exit_code:  # e.g. made with an earlier version of the pipeline file
                raise DemoError(
                    f"{paths['cache']} or {paths['run']} was made with other settings than {cfg}: remove "
                    f"{paths['cache']} and {paths['run']} to rebuild them",
                    err.code,
                ) from None
            raise
        save_state(state_path, state)
        header("5/8 held-out estimate: the trainer's final eval on held-out samples (full-depth chains)")
        ev = final_eval(paths["run"])[0]
        print(json.dumps(ev) if ev else "no eval record in metrics.jsonl", flush=True)
        header("6/8 export: speculators P-EAGLE format (config.json + model.safetensors)")
        cli("export", str(paths["run"]), "--output", str(paths["export"]))
        header("7/8 plot: loss, per-depth agreement, acceptance")
        cli("plot", str(paths["run"]))
        failure: DemoError | None = None
        try:
            vllm = evaluate(paths, state, args.vllm)
        except DemoError as err:  # a failed measurement still gets a summary
            failure, vllm = err, None
        save_state(state_path, state)
        header("summary")
        table = summary(paths, state, vllm, load0)
        print(table, flush=True)
        (d / SUMMARY_FILE).write_text(
            f"# peagle-pipeline demo summary\n\n`make demo` ({time.strftime('%Y-%m-%d %H:%M')})\n\n{table}\n"
        )
        print(f"\nwritten to {d / SUMMARY_FILE}", flush=True)
        if failure is not None:
            raise failure
    except DemoError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        print("error: interrupted: finished work is kept; run `make demo` again to continue", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 (the demo's one error boundary)
        if os.environ.get("PEAGLE_DEBUG") == "1":
            raise
        print(f"error: demo failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
