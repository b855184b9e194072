"""What a lossy cache costs in acceptance length: drafts trained from bf16, fp8 and nf4 caches of the same data, at
the same steps and seed, measured side by side in vLLM (MT-Bench and HumanEval by default, K = 4, T = 0), with
one row trained twice (another seed) for the noise.

    python experiments/lossy_cache_al.py --dir .lossy-al [--model DIR --data FILE --samples 2000 --steps 600
        --dtypes bf16,fp8,nf4 --noise-dtype bf16 --prompts mt-bench,humaneval --num-prompts 80 --concurrency 16 --doc FILE]

Every stage is the real CLI in a subprocess (`extract` and `train` in .venv, `evaluate` in .venv-vllm) and resumes,
so a re-run only does what is missing. The caches share one forward dtype (`--compute-dtype`, default bf16) and
every setting but `--dtype`; the drafts share every training setting (`--train-flag` adds one, repeatable). The
defaults are sized for about an hour on a 2-core CPU host with the demo's SmolLM2-135M; `--toy` is a smoke run
(minutes; its figures mean nothing). Writes DIR/eval/report.json (evaluate's own), DIR/lossy_al.json (the table's
figures: AL per draft and prompt set, the noise row, the difference to bf16) and, with --doc, a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV_PY = REPO / ".venv" / "bin" / "python"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
DEMO_MODEL = REPO / ".demo" / "models" / "SmolLM2-135M-Instruct"
DEMO_DATA = REPO / ".demo" / "data" / "sharegpt.jsonl"


def cli(python: Path, *args: str) -> None:
    """`peagle-pipeline ARGS` with `python` (progress to the terminal); exits with its code when it fails."""
    proc = subprocess.run([str(python), "-m", "peagle_pipeline.cli", *args], cwd=REPO)
    if proc.returncode != 0:
        print(f"error: `peagle-pipeline {args[0]}` failed with exit code {proc.returncode}", file=sys.stderr)
        raise SystemExit(proc.returncode)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path, help="working directory (caches, runs, reports)")
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--samples", type=int, default=2000, help="rows extracted (the first ones)")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument(
        "--compute-dtype", default="bf16", help="the target forward's dtype, shared by every cache"
    )
    ap.add_argument("--dtypes", default="bf16,fp8,nf4", help="stored dtypes compared, comma-separated")
    ap.add_argument("--noise-dtype", default="bf16", help="the row trained a second time, with --noise-seed")
    ap.add_argument("--noise-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--depths", type=int, default=4, help="K trained and evaluated")
    ap.add_argument("--train-flag", action="append", default=[], help="another train flag (e.g. --lr=1e-3)")
    ap.add_argument("--prompts", default="mt-bench,humaneval", help="evaluate's prompt sets, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="requests in flight in the evaluation (AL is read from it)",
    )
    ap.add_argument(
        "--toy", action="store_true", help="smoke sizes: 16 rows, 8 steps, 4 prompts of 16 tokens"
    )
    ap.add_argument("--doc", type=Path, default=None, help="also write the table as Markdown here")
    ap.add_argument("--python", type=Path, default=VENV_PY, help="interpreter of extract and train")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PY, help="interpreter of evaluate (vLLM)")
    args = ap.parse_args()
    if args.toy:
        args.samples, args.max_length, args.steps, args.tokens_per_step = 16, 256, 8, 512
        args.num_prompts, args.max_tokens = 4, 16
    return args


def extract(args: argparse.Namespace, dtype: str) -> Path:
    out = args.dir / f"cache-{dtype}"
    cli(args.python, "extract", "--model", args.model, "--data", args.data, "--output", str(out),
        "--max-samples", str(args.samples), "--max-length", str(args.max_length), "--dtype", dtype,
        "--compute-dtype", args.compute_dtype)  # fmt: skip
    return out


def train(args: argparse.Namespace, cache: Path, name: str, seed: int) -> Path:
    """A draft of `cache` (resumed when its run exists); returns its export."""
    run = args.dir / f"run-{name}"
    resume = ["--resume"] if (run / "checkpoints" / "latest").exists() else []
    if not (run / "export" / "config.json").exists():
        cli(args.python, "train", "--cache", str(cache), "--output", str(run), "--steps", str(args.steps),
            "--tokens-per-step", str(args.tokens_per_step), "--depths", str(args.depths), "--seed", str(seed),
            *resume, *args.train_flag)  # fmt: skip
    return run / "export"


def table(report: dict[str, Any], names: dict[str, str], base: str, noise: str) -> dict[str, Any]:
    """AL per draft and prompt set from evaluate's report, the noise (the twice-trained row's two ALs) and each
    draft's difference to `base`'s."""
    al: dict[str, dict[str, float]] = {}
    for r in report["results"]:
        name = names.get(str(Path(r["draft"]).parent.name), r["draft"])
        al.setdefault(name, {})[r["prompt_set"]] = r["acceptance_length"]
    sets = sorted({s for row in al.values() for s in row})
    diff = {n: {s: al[n][s] - al[base][s] for s in sets if s in al[n] and s in al.get(base, {})} for n in al}
    spread = {s: abs(al[noise][s] - al[f"{noise} (seed 2)"][s]) for s in sets if f"{noise} (seed 2)" in al}
    return {"acceptance_length": al, "vs_" + base: diff, "noise": spread, "prompt_sets": sets}


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    sets, base = result["prompt_sets"], args.dtypes.split(",")[0]
    lines = [
        f"| cache | {' | '.join(f'AL {s}' for s in sets)} | {' | '.join(f'vs {base} ({s})' for s in sets)} |",
        "|---|" + "---:|" * (2 * len(sets)),
    ]
    for name, row in result["acceptance_length"].items():
        d = result["vs_" + base][name]
        cells = [f"{row.get(s, float('nan')):.3f}" for s in sets] + [f"{d.get(s, 0.0):+.3f}" for s in sets]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    noise = ", ".join(f"{s} {v:.3f}" for s, v in result["noise"].items())
    lines.append(f"\nNoise (the {args.noise_dtype} row trained with two seeds, |AL difference|): {noise}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse()
    args.dir.mkdir(parents=True, exist_ok=True)
    dtypes = args.dtypes.split(",")
    exports: dict[str, Path] = {}
    names: dict[str, str] = {}
    for dtype in dtypes:
        exports[dtype] = train(args, extract(args, dtype), dtype, 0)
        names[f"run-{dtype}"] = dtype
    noisy = f"{args.noise_dtype} (seed 2)"
    exports[noisy] = train(
        args, args.dir / f"cache-{args.noise_dtype}", f"{args.noise_dtype}-seed2", args.noise_seed
    )
    names[f"run-{args.noise_dtype}-seed2"] = noisy
    report_dir = args.dir / "eval"
    if not (report_dir / "report.json").exists():
        prompts = [x for s in args.prompts.split(",") for x in ("--prompts", s)]
        cli(args.vllm_python, "evaluate", *map(str, exports.values()), *prompts, "--num-prompts", str(args.num_prompts),
            "--max-tokens", str(args.max_tokens), "--temperature", "0", "--depths", str(args.depths),
            "--concurrency", str(args.concurrency), "--acceptance-concurrency", str(args.concurrency),
            "--output", str(report_dir))  # fmt: skip
    result = table(json.loads((report_dir / "report.json").read_text()), names, dtypes[0], args.noise_dtype)
    (args.dir / "lossy_al.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result, args)
    print("\n" + text)
    if args.doc:
        args.doc.parent.mkdir(parents=True, exist_ok=True)
        args.doc.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
