"""Every benchmark figure in one run (`make bench`): runs the benchmark scripts one after the other, then writes
OUT/report.md and OUT/report.json with each figure, its goal, and whether it is met.

    python -m bench.run_all --out bench/results [--quick] [--only extract,cache,...]

Each script runs as a subprocess (its own tables go to the terminal) and writes OUT/<name>.json; this script only
reads those files. Figures are ratios measured side by side in the same process on this machine, never absolute
times. The speculators comparison runs in `.venv-bench` (`make setup-bench`), the generate and vLLM-extraction benchmarks in
`.venv-vllm` (`make setup-vllm`); the quality figures come from the latest `make demo` (read from --demo-dir, default .demo,
not re-run here). A script that fails is reported as such, the others still run, and the exit code is non-zero. Sizes are chosen
so the whole run stays around 20-30 minutes on 2 CPU cores (the generate benchmark starts three vLLM engines); --quick shrinks every benchmark to a smoke test (its figures are not meaningful).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import ROOT
from bench.report_chart import write_chart

BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
DEMO = ROOT / ".demo"


@dataclass
class Bench:
    """One benchmark script: how to run it (full and quick arguments) and which interpreter."""

    name: str
    script: str
    args: list[str]
    quick_args: list[str]
    python: Path | None = None  # None = this interpreter
    ran: dict[str, Any] = field(default_factory=dict)


BENCHES = [
    Bench(
        "extract",
        "bench_extract.py",
        ["--samples", "64", "--max-length", "512", "--rounds", "3"],
        ["--samples", "4", "--max-length", "256"],
    ),
    Bench(
        "cache",
        "bench_cache.py",
        ["--samples", "48", "--max-length", "1024", "--repeats", "5"],
        ["--samples", "4", "--max-length", "256", "--repeats", "2"],
    ),
    Bench(
        "step", "bench_step.py", ["--tokens", "2048", "--repeat", "2"], ["--tokens", "256", "--repeat", "1"]
    ),
    Bench(
        "speculators", "bench_speculators.py", ["--tokens", "2048", "--repeat", "2"], ["--quick"], BENCH_PY
    ),
    Bench(
        "partition_memory",
        "bench_partition_memory.py",
        ["--tokens", "4096", "--samples", "2"],
        ["--tokens", "1024", "--samples", "1"],
    ),
    Bench(
        "dtype",
        "bench_dtype.py",
        ["--samples", "16", "--max-length", "512", "--tokens", "2048", "--repeat", "3"],
        ["--samples", "2", "--max-length", "128", "--tokens", "256", "--repeat", "1"],
    ),
    Bench(
        "generate",
        "bench_generate.py",
        ["--prompts", "64", "--max-new-tokens", "256"],
        ["--prompts", "4", "--max-new-tokens", "16"],
        VLLM_PY,
    ),
    Bench(
        "vllm_extract",
        "bench_vllm_extract.py",
        ["--samples", "24", "--max-length", "512"],
        ["--samples", "4", "--max-length", "128"],
        VLLM_PY,
    ),
    Bench(
        "fp8",
        "bench_fp8.py",
        ["--samples", "16", "--max-length", "512"],
        ["--quick"],
    ),
    Bench(
        "loader",
        "bench_loader.py",
        ["--samples", "24", "--max-length", "1024", "--repeats", "3"],
        ["--quick"],
    ),
    Bench(
        "data_wait",
        "bench_data_wait.py",
        ["--samples", "32", "--max-length", "512", "--steps", "24"],
        ["--quick"],
    ),
    Bench(
        "data_wait_s3",
        "bench_data_wait.py",
        ["--samples", "32", "--max-length", "512", "--steps", "24", "--s3-mbit", "200"],
        ["--quick", "--s3-mbit", "200"],
    ),
]


def run_bench(b: Bench, out: Path, quick: bool) -> None:
    """Run one script; record seconds, load average and exit code in b.ran."""
    py = b.python or Path(sys.executable)
    if not py.exists():
        setup = "make setup-vllm" if py == VLLM_PY else "make setup-bench"
        b.ran = {"status": "not run", "why": f"{py.relative_to(ROOT)} missing: run `{setup}`"}
        print(f"\n### {b.name}: not run ({b.ran['why']})", flush=True)
        return
    result = out / f"{b.name}.json"
    result.unlink(missing_ok=True)  # never report a previous run's numbers as this run's
    shown = os.path.relpath(result, ROOT) if result.is_relative_to(ROOT) else str(result)
    module = f"bench.{Path(b.script).stem}"  # run as a module from the root: `bench` imports as a package
    cmd = [str(py), "-m", module, "--out", shown, *(b.quick_args if quick else b.args)]
    print(f"\n### {b.name}: {' '.join(cmd[1:])}", flush=True)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT).returncode
    b.ran = {
        "status": "ok" if code == 0 and result.is_file() else "failed",
        "exit_code": code,
        "seconds": round(time.perf_counter() - t0, 1),
        "load_avg_start": round(load0, 2),
        "load_avg_end": round(os.getloadavg()[0], 2),
        "command": " ".join(["python" if b.python is None else str(py.relative_to(ROOT)), *cmd[1:]]),
    }


# -------------------------------------------------------------------------------------------- figures
def _load(out: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _fig(
    figure: str, goal: str, source: str, value: float | None, text: str, met: bool | None, note: str = ""
) -> dict[str, Any]:
    return {
        "figure": figure,
        "goal": goal,
        "source": source,
        "value": value,
        "measured": text,
        "met": met,
        "note": note,
    }


def _dtype_cap(r: dict[str, Any]) -> str:
    """What bench_dtype measured over, when its time cap cut a path short (an emulated bf16), else nothing."""
    if not r.get("time_capped"):
        return ""
    return (
        f"; time-capped: {r['extract_batches_measured']} extraction batches, {r['train_steps_measured']} "
        "training steps after the warm-up"
    )


def figures(out: Path, demo: Path | None = None) -> list[dict[str, Any]]:
    """Each benchmark figure from the scripts' JSON (None values = not measured in this run), and the quality
    figures of the `make demo` in `demo` (default DEMO)."""
    figs: list[dict[str, Any]] = []
    missing = "not measured (script failed or not run)"

    r = _load(out, "extract")
    figs.append(
        _fig(
            "Extraction throughput vs bare target forward (HF backend)",
            ">= 0.90x",
            "bench_extract",
            r and r["ratio"],
            f"{r['ratio']:.3f}x ({r['extract_tokens_per_s']:.0f} vs "
            f"{r['bare_tokens_per_s']:.0f} tokens/s, {r['tokens']} tokens"
            + (
                f" x {r['rounds']} rounds: " + " / ".join(f"{x:.3f}x" for x in r["round_ratios"])
                if r.get("rounds", 1) > 1
                else ""
            )
            + ")"
            if r
            else missing,
            r and r["ratio"] >= 0.90,
        )
    )

    r = _load(out, "cache")
    if r:
        size = r["size_ratio"]["ours-auto"]
        figs.append(
            _fig(
                "Cache bytes per token vs one safetensors file per sample",
                "<= 0.80x, aux bit-exact",
                "bench_cache",
                size,
                f"{size:.3f}x ({r['bytes_per_token']['ours-auto']:.0f} vs "
                f"{r['bytes_per_token']['per-sample']:.0f} B/token); aux bit-exact: {r['aux_bit_exact']}",
                size <= 0.80 and bool(r["aux_bit_exact"]),
                "per-sample files hold the last hidden state too (the common format); ours does not",
            )
        )
        for label, key, note in (
            (
                "warm: files in the page cache",
                "",
                "both formats read from RAM; ours also checks a crc32c/zstd checksum of every chunk, the safetensors files are mapped unchecked",
            ),
            (
                "cold: files evicted from the page cache",
                "cold_",
                "bytes come from disk, as when the cache is larger than RAM",
            ),
        ):
            ratio, rate = (
                r.get(f"{key}read_ratio", {}).get("ours-auto"),
                r.get(f"{key}reads_samples_per_s", {}),
            )
            figs.append(
                _fig(
                    f"Random-order sample reads vs per-sample safetensors ({label})",
                    ">= 1.0x",
                    "bench_cache",
                    ratio,
                    f"{ratio:.2f}x ({rate['ours-auto']:.0f} vs {rate['per-sample']:.0f} samples/s; "
                    f"compress none: {r[f'{key}read_ratio']['ours-none']:.2f}x)"
                    if ratio is not None
                    else missing,
                    None if ratio is None else ratio >= 1.0,
                    note,
                )
            )
    else:
        figs += [
            _fig(
                "Cache bytes per token vs one safetensors file per sample",
                "<= 0.80x, aux bit-exact",
                "bench_cache",
                None,
                missing,
                None,
            ),
        ] + [
            _fig(
                f"Random-order sample reads vs per-sample safetensors ({label})",
                ">= 1.0x",
                "bench_cache",
                None,
                missing,
                None,
            )
            for label in ("warm: files in the page cache", "cold: files evicted from the page cache")
        ]

    r = _load(out, "generate")
    figs.append(
        _fig(
            "`generate` through vLLM vs a bare LLM.generate of the same prompts and settings",
            ">= 0.90x",
            "bench_generate",
            r and r["ratio"],
            f"{r['ratio']:.3f}x ({r['generate_tokens_per_s']:.1f} vs {r['bare_tokens_per_s']:.1f} generated "
            f"tokens/s; {r['prompts']} prompts, max_new_tokens {r['max_new_tokens']}, T={r['temperature']}; "
            f"replies identical: {r['identical_replies']}/{r['prompts']})"
            if r
            else missing,
            r and r["ratio"] >= 0.90,
            "each side starts its own engine; only generation is timed",
        )
    )

    r = _load(out, "vllm_extract")
    figs.append(
        _fig(
            "Extraction through vLLM vs a bare vLLM prefill of the same prompts",
            ">= 0.85x",
            "bench_vllm_extract",
            r and r["ratio"],
            f"{r['ratio']:.3f}x ({r['extract_tokens_per_s']:.0f} vs {r['bare_tokens_per_s']:.0f} tokens/s, "
            f"{r['tokens']} tokens, vLLM {r['vllm']} on {r['device']}"
            + (
                f"; the bare prefill with prompt_logprobs={r['topk']}, vLLM's own part: {r['logprobs_ratio']:.3f}x, "
                f"extraction vs it: {r['extract_vs_logprobs']:.3f}x)"
                if "logprobs_ratio" in r
                else ")"
            )
            + (
                f"; this target's ceiling, with the lm_head on every row: {r['matmul_ceiling']:.3f}x"
                if r.get("matmul_ceiling")
                else ""
            )
            + (f"; measured {r['measured_at']} on {r['cpu']}" if "measured_at" in r else "")
            if r
            else missing,
            r and r["ratio"] >= 0.85,
            "both engines run side by side on the same cores; engine start excluded; bare = max_tokens 1, no log-probs",
        )
    )

    r = _load(out, "data_wait")
    figs.append(
        _fig(
            "Training data-wait fraction of step time (steady state)",
            "< 5 %",
            "bench_data_wait",
            r and r["data_wait_steady"],
            f"{100 * r['data_wait_steady']:.2f} % (first window, with "
            f"worker start-up: {100 * r['data_wait_first_window']:.1f} %; all: "
            f"{100 * r['data_wait_all']:.2f} %)"
            if r
            else missing,
            r and r["data_wait_steady"] < 0.05,
        )
    )

    r = _load(out, "data_wait_s3")
    figs.append(
        _fig(
            "Training data-wait fraction, cache read from S3 (local moto server behind a limited proxy)",
            "< 5 %",
            "bench_data_wait --s3-mbit",
            r and r["data_wait_steady"],
            f"{100 * r['data_wait_steady']:.2f} % at {r['s3_mbit']:g} Mbit/s and {r['s3_latency_ms']:g} ms per "
            f"read (first window: {100 * r['data_wait_first_window']:.1f} %)"
            if r
            else missing,
            r and r["data_wait_steady"] < 0.05,
        )
    )

    r = _load(out, "step")
    figs.append(
        _fig(
            "Training step vs reference P-EAGLE step (dense mask, unchunked loss)",
            ">= 1.0x, equal loss",
            "bench_step",
            r and r["speedup"],
            f"{r['speedup']:.2f}x ({r['optimised_tok_s']:.0f} vs "
            f"{r['reference_tok_s']:.0f} tokens/s); loss rel diff {r['loss_rel_diff']:.1e}"
            if r
            else missing,
            r and r["speedup"] >= 1.0 and r["loss_rel_diff"] < 1e-4,
        )
    )

    r = _load(out, "speculators")
    figs.append(
        _fig(
            "Training step vs speculators==0.9.0 P-EAGLE step (same config, batch, COD elements)",
            ">= 1.0x, equal loss",
            "bench_speculators",
            r and r["ratio"],
            f"{r['ratio']:.2f}x exact target ({r['tokens_per_s']['ours_exact']:.0f} vs "
            f"{r['tokens_per_s']['speculators']:.0f} tokens/s; our top-k step {r['ratio_topk']:.2f}x); "
            f"same COD elements: {r['same_cod_elements']}; loss rel diff {r['loss_rel_diff']:.1e}"
            if r
            else missing,
            r and r["ratio"] >= 1.0 and r["loss_rel_diff"] < 1e-4 and r["same_cod_elements"],
        )
    )

    r = _load(out, "partition_memory")
    figs.append(
        _fig(
            "Peak step memory, 1 vs 4 sequence segments at 4k-token samples",
            ">= 2.5x lower",
            "bench_partition_memory",
            r and r["ratio"],
            f"{r['ratio']:.2f}x ({r['runs'][0]['peak_mib']:.0f} vs {r['runs'][1]['peak_mib']:.0f} MiB, "
            f"{r['samples']} x {r['tokens_per_sample']} tokens); loss rel diff {r['loss_rel_diff']:.1e}"
            if r
            else missing,
            r and r["ratio"] >= 2.5,
        )
    )
    r = _load(out, "fp8")
    figs.append(
        _fig(
            "fp8 aux storage (`--dtype fp8`): bytes per token vs the lossless cache, and its error",
            "smaller; error reported (no goal)",
            "bench_fp8",
            r and r["fp8_vs_lossless"],
            f"{r['fp8_vs_lossless']:.3f}x of lossless ({r['bytes_per_token']['ours-fp8']:.0f} vs "
            f"{r['bytes_per_token']['ours-bf16 (lossless, default)']:.0f} B/token; per-sample "
            f"{r['bytes_per_token']['per-sample (aux + last hidden)']:.0f}); aux relative L2 error "
            f"{r['error']['rel_l2']:.4f}"
            if r
            else missing,
            r and r["fp8_vs_lossless"] < 1.0,
            "lossy opt-in; the quality cost (AL of a draft trained on it) is not measured yet",
        )
    )
    figs += loader_figures(out)
    r = _load(out, "dtype")
    figs.append(
        _fig(
            "Compute dtype chosen from the hardware (auto) vs the other: extraction and training step",
            ">= 1.0x both",
            "bench_dtype",
            r and min(r["extract_ratio"], r["train_ratio"]),
            f"auto = {r['chosen']} ({', '.join(r['cpu_bf16_flags']) or 'no bf16 units'}): extraction "
            f"{r['extract_ratio']:.2f}x ({r['extract_tokens_per_s']['bf16']:.0f} bf16 vs "
            f"{r['extract_tokens_per_s']['fp32']:.0f} fp32 tokens/s), training step {r['train_ratio']:.2f}x "
            f"({r['train_tokens_per_s']['bf16']:.0f} vs {r['train_tokens_per_s']['fp32']:.0f})"
            + _dtype_cap(r)
            if r
            else missing,
            r and min(r["extract_ratio"], r["train_ratio"]) >= 1.0,
            "measures the CPU it runs on; a host without AMX / AVX512-BF16 picks fp32",
        )
    )
    figs += demo_figures(demo)
    return figs


def loader_figures(out: Path) -> list[dict[str, Any]]:
    """bench_loader's rows: reads per core of each stored dtype (decode included) next to a GPU step's need, and the
    nf4 aux states' size against bf16's."""
    r = _load(out, "loader")
    missing = "not measured (script failed or not run)"
    rates = r["tokens_per_s_per_core"] if r else {}
    need = r["need_tokens_per_s"] if r else 0
    speed = _fig(
        "Loader reads per CPU core (decode included): bf16 / fp8 / nf4, next to an H200 step's need",
        "reported (cores needed)",
        "bench_loader",
        r and min(rates.values()),
        " / ".join(f"{k} {v:,.0f} tokens/s ({need / v:.1f} cores)" for k, v in rates.items())
        + f" for {need:,} tokens/s"
        if r
        else missing,
        None,
        "one torch thread, files in the page cache; the cores a trainer's loader workers need to keep the step fed",
    )
    size = _fig(
        "nf4 aux storage (`--dtype nf4`): aux bytes per token vs bf16",
        f"<= {r['goals']['nf4_aux_vs_bf16_max'] if r else 0.30:.2f}x",
        "bench_loader",
        r and r["nf4_aux_vs_bf16"],
        f"{r['nf4_aux_vs_bf16']:.3f}x ({r['aux_bytes_per_token']['nf4']:.0f} vs {r['aux_bytes_per_token']['bf16']:.0f} "
        f"B/token; whole cache {r['nf4_vs_bf16']:.3f}x)"
        if r
        else missing,
        r and r["nf4_aux_vs_bf16"] <= r["goals"]["nf4_aux_vs_bf16_max"],
        "lossy opt-in; its AL cost: experiments/lossy_cache_al.py",
    )
    return [speed, size]


def demo_figures(demo: Path | None = None) -> list[dict[str, Any]]:
    """Quality figures from the latest `make demo` in `demo` (default DEMO; not re-run here)."""
    from peagle_pipeline.stages.train.metrics import read_metrics

    demo = demo or DEMO
    made_by = "make demo" if demo == DEMO else f"make demo DEMO_DIR={demo.name}"
    evals = [r for r in read_metrics(demo / "run") if r.get("kind") == "eval"]
    ev = evals[-1] if evals else None
    acc = ev and ev.get("acceptance")
    agree = ", ".join("-" if a is None else f"{a:.2f}" for a in ev["agreement"]) if ev else ""
    figs = [
        _fig(
            "Demo: estimated acceptance length on held-out samples (per-depth agreement)",
            "well above 1",
            made_by,
            acc,
            f"{acc:.3f} (agreement per depth: {agree}; step {ev['step']})"
            if acc
            else "not measured (run `make demo`)",
            None if acc is None else acc >= 1.5,
            "'well above 1' read as >= 1.5",
        )
    ]
    row = demo_vllm_row(demo)
    va = row and row.get("acceptance_length")
    per_pos = " / ".join(f"{a:.2f}" for a in row["acceptance_per_position"]) if va else ""
    speed = row and (row.get("throughput") or [None])[0]
    figs.append(
        _fig(
            "Demo: vLLM-measured acceptance length on MT-Bench (the export loaded by vLLM's parallel drafting)",
            "loads; reported",
            f"{made_by} (evaluate)",
            va,
            f"{va:.3f} (per position {per_pos}; {row['prompts']} prompts x {row['max_tokens']} new tokens, "
            f"K = {row['depths']}, T = {row['temperature']:g}; trainer estimate {row.get('trainer_estimate') or 0:.3f}"
            + (
                f"; {speed['speedup']:.2f}x the plain target's tokens/s at {speed['concurrency']} in flight"
                if speed
                else ""
            )
            + "); greedy output "
            + (
                "identical to plain decoding"
                if row["identical"]
                else f"parts from plain decoding on {row['mismatched_prompts']} of {row['prompts']} prompts "
                "(near-ties under bf16, docs/guides/evaluate.md)"
            )
            if va
            else "not measured (make setup-vllm, then make demo)",
            None if row is None else va is not None,
        )
    )
    return figs


def demo_vllm_row(demo: Path) -> dict[str, Any] | None:
    """The MT-Bench row of the latest `make demo` evaluation (DEMO_DIR/eval/report.json), or None."""
    try:
        rows = json.loads((demo / "eval" / "report.json").read_text())["results"]
    except (OSError, ValueError, KeyError):
        return None
    return next((r for r in rows if r.get("prompt_set") == "mt-bench"), None)


def render(figs: list[dict[str, Any]], meta: dict[str, Any], benches: list[Bench]) -> str:
    mark = {True: "met", False: "**not met**", None: "n/a"}
    lines = [
        "# Benchmark report",
        "",
        f"`{meta['command']}` started {meta['date']}, ran {meta.get('seconds', 0) / 60:.1f} min: "
        f"{meta['machine']}; load average {meta['load_avg_start']} at "
        f"start, {meta['load_avg_end']} at end (the machine is shared). Python {meta['python']}, torch "
        f"{meta['torch']}. Every figure is a ratio measured side by side in one process; see docs/results/benchmarks.md."
        + (" **Quick mode: smoke-test sizes, the figures are not meaningful.**" if meta["quick"] else ""),
        "",
        "| figure | measured | goal | status | source |",
        "|---|---|---|---|---|",
    ]
    for f in figs:
        note = f" ({f['note']})" if f["note"] else ""
        lines.append(
            f"| {f['figure']} | {f['measured']}{note} | {f['goal']} | {mark[f['met']]} | {f['source']} |"
        )
    lines += ["", "| script | status | seconds | load avg (start/end) | command |", "|---|---|---:|---|---|"]
    for b in benches:
        r = b.ran
        lines.append(
            f"| {b.script} | {r.get('status')}{' (' + r['why'] + ')' if 'why' in r else ''} | "
            f"{r.get('seconds', '')} | {r.get('load_avg_start', '')}/{r.get('load_avg_end', '')} | "
            f"`{r.get('command', '')}` |"
        )
    return "\n".join(lines) + "\n"


def write_report(out: Path, meta: dict[str, Any], demo: Path) -> str:
    """OUT/report.json, OUT/report.md and its chart OUT/report.png from the scripts' JSON files in OUT, the run's
    `meta` and each Bench's `ran`; returns the markdown."""
    figs = figures(out, demo)
    (out / "report.json").write_text(
        json.dumps({"meta": meta, "figures": figs, "scripts": {b.name: b.ran for b in BENCHES}}, indent=2)
        + "\n"
    )
    report = render(figs, meta, BENCHES)
    title = f"`{meta['command']}`, {meta['date']}: {meta['machine']}"
    if write_chart(figs, out / "report.png", title.replace("`", "")) is not None:
        report += "\n![each figure against its goal](report.png)\n"
    else:  # no figure with a numeric goal: leave no chart of an older run behind
        (out / "report.png").unlink(missing_ok=True)
    (out / "report.md").write_text(report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (figures not meaningful)")
    ap.add_argument(
        "--only", default="", help="comma-separated benchmark names to run (the report reads all)"
    )
    ap.add_argument(
        "--demo-dir", default=str(DEMO), help="the `make demo` directory whose figures the report quotes"
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="run nothing: re-write the report from OUT's JSON files and the run OUT/report.json records",
    )
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    demo = Path(args.demo_dir).resolve()
    if args.render:
        try:
            saved = json.loads((out / "report.json").read_text())
        except (OSError, ValueError) as err:
            print(f"error: cannot re-write the report: {out / 'report.json'}: {err}", file=sys.stderr)
            return 2
        for b in BENCHES:
            b.ran = saved.get("scripts", {}).get(b.name, {"status": "not run"})
        print(write_report(out, saved["meta"], demo))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    unknown = only - {b.name for b in BENCHES}
    if unknown:
        print(
            f"error: unknown benchmark(s) {sorted(unknown)}; choose from {[b.name for b in BENCHES]}",
            file=sys.stderr,
        )
        return 2
    load0, t0, started = os.getloadavg()[0], time.perf_counter(), time.gmtime()
    for b in BENCHES:
        if not only or b.name in only:
            run_bench(b, out, args.quick)
        else:
            b.ran = {"status": "skipped (--only)"}
    import torch

    meta = {
        "command": "make bench" + (" (--quick)" if args.quick else "")
        if not only
        else f"run_all.py --only {args.only}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", started),  # when the run started
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_start": round(load0, 2),
        "load_avg_end": round(os.getloadavg()[0], 2),
        "seconds": round(time.perf_counter() - t0, 1),
        "quick": args.quick,
    }
    report = write_report(out, meta, demo)
    print(
        "\n" + report + f"\nwritten to {out / 'report.md'} and report.json ({meta['seconds'] / 60:.1f} min)"
    )
    failed = [b.name for b in BENCHES if b.ran.get("status") == "failed"]
    if failed:
        print(f"error: benchmark script(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
