"""How an `evaluate` report is shown: the printed table, the per-position acceptance chart and the comparison chart
(AL and speedup against K, a line per draft) (PNGs).

Both read only the report dict (`evaluate.build_report`), so a saved report.json can be shown again. Never runs
vLLM; writes only the chart file it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peagle_pipeline.stages.evaluate.acceptance import METHOD_NAMES as METHODS

__all__ = ["format_table", "plot_acceptance", "plot_comparison"]


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


def _greedy_check(r: dict[str, Any]) -> str:
    """The `= plain` cell of a result row: n/a at T>0, else whether the outputs matched the plain target's."""
    if r["identical"] is None:
        return "n/a (T>0)"
    return "yes" if r["identical"] else f"NO ({r['mismatched_prompts']}/{r['prompts']} differ)"


def _estimate_cell(estimate: float | None, walk: float | None) -> str:
    """The trainer's anchor mean, and beside it the walk of the same evaluation where the run recorded one."""
    return _f(estimate) if walk is None else f"{_f(estimate)} (walk {_f(walk)})"


def _at_acceptance(r: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """The throughput entry of a result row measured at the acceptance concurrency ({} if none)."""
    return next((t for t in r["throughput"] if t["concurrency"] == concurrency), {})


def _speedup(t: dict[str, Any]) -> str:
    return "-" if t.get("speedup") is None else f"{t['speedup']:.2f}x"


def _acceptance_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per draft, K and prompt set: method, K, prompts, AL, per-position acceptance, tokens/s without and
    with the draft and the speedup (at the acceptance concurrency), trainer estimate, = plain."""
    acc_rows = []
    ac = report["settings"].get("acceptance_concurrency", 1)
    for r in report["results"]:
        per = r["acceptance_per_position"]
        t = _at_acceptance(r, ac)
        acc_rows.append(
            [
                r["prompt_set"],
                r["draft"],
                METHODS.get(r.get("method", "peagle"), r.get("method", "?")),
                str(r["depths"]),
                str(r["prompts"]),
                _f(r["acceptance_length"]),
                " ".join(_f(p, ".2f") for p in per) if per else "-",
                f"{_f(t.get('plain_tokens_per_s'), '.1f')} -> {_f(t.get('tokens_per_s'), '.1f')}",
                _speedup(t),
                _estimate_cell(r["trainer_estimate"], r.get("trainer_walk")),
                _greedy_check(r),
            ]
        )
    return acc_rows


def _throughput_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per draft, prompt set and concurrency: tokens/s with and without the draft, speedup, AL."""
    tp_rows = []
    for r in report["results"]:
        for t in r["throughput"]:
            tp_rows.append(
                [
                    r["prompt_set"],
                    r["draft"],
                    str(t["depths"]),
                    str(t["concurrency"]),
                    _f(t["plain_tokens_per_s"], ".1f"),
                    _f(t["tokens_per_s"], ".1f"),
                    _speedup(t),
                    _f(t["acceptance_length"]),
                ]
            )
    return tp_rows


def _estimate_lines(report: dict[str, Any]) -> list[str]:
    """One line per draft: the trainer's estimates (exported step, last, best), or that its run was not found."""
    lines = []
    for d in report["drafts"]:
        e = d["trainer_estimate"]
        if e is not None:
            exported = e.get("exported_acceptance_length")
            at_export = (
                f"exported step {e['exported_step']} {_estimate_cell(exported, e.get('exported_acceptance_walk'))}, "
                if exported is not None
                else ""
            )
            last = _estimate_cell(e["acceptance_length"], e.get("acceptance_walk"))
            lines.append(
                f"trainer estimate for {d['name']} (held-out, K={e['depths']}): {at_export}last "
                f"{last} at step {e['step']}, best {_f(e['best_acceptance_length'])} at step "
                f"{e['best_step']} ({e['run']})"
            )
        else:
            lines.append(f"trainer estimate for {d['name']}: - (its training run was not found)")
    return lines


def format_table(report: dict[str, Any]) -> str:
    """The report as text: acceptance per draft and prompt set, then tokens/s and speedup per concurrency."""
    s = report["settings"]
    cond = (
        f"T={s['temperature']:g}, max {s['max_tokens']} new tokens, prefix caching off, "
        f"{report['dtype']}, on {report['hardware']}"
    )
    lines = [
        f"vLLM acceptance (concurrency {s.get('acceptance_concurrency', 1)}; {cond}); target {report['target']}"
    ]
    lines += _table(
        [
            "prompt set",
            "draft",
            "method",
            "K",
            "prompts",
            "AL",
            "per position 1..K",
            "tok/s plain -> draft",
            "speedup",
            "trainer est. AL",
            "= plain",
        ],
        _acceptance_rows(report),
    )
    lines.append(f"output tokens/s with and without the draft ({cond})")
    lines += _table(
        ["prompt set", "draft", "K", "concurrency", "plain tok/s", "draft tok/s", "speedup", "AL"],
        _throughput_rows(report),
    )
    if report["dtype"] == "bf16" and any(r["identical"] is False for r in report["results"]):
        lines.append(
            "note: in bf16 the target verifies K+1 tokens per forward and rounds differently from one-token "
            "decoding, so greedy near-ties can flip and the texts part; --dtype fp32 checks exact equality"
        )
    starts = ", ".join(f"{k} {v:.1f} s" for k, v in report["engine_start_seconds"].items())
    lines.append(f"engine start: {starts}; total {report['wall_seconds']:.0f} s")
    lines += _estimate_lines(report)
    return "\n".join(lines)


def plot_acceptance(report: dict[str, Any], path: str | Path) -> Path:
    """Grouped bars of per-position acceptance: one panel per prompt set, one bar per draft at each position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [p["name"] for p in report["prompt_sets"]]
    drafts = [d["name"] for d in report["drafts"]]
    by_key = {(r["draft"], r["prompt_set"]): r for r in report["results"]}
    kmax = max((r["depths"] for r in report["results"]), default=1)
    fig, axes = plt.subplots(1, len(sets), figsize=(max(5.0, 4.5 * len(sets)), 4), dpi=110, squeeze=False)
    width = 0.8 / max(1, len(drafts))
    for ax, name in zip(axes[0], sets, strict=True):
        for j, d in enumerate(drafts):
            r = by_key.get((d, name))
            rates = (r or {}).get("acceptance_per_position") or []
            xs = [i + 1 + (j - (len(drafts) - 1) / 2) * width for i in range(len(rates))]
            label = f"{d} (K={r['depths']}, AL {_f(r['acceptance_length'])})" if r else d
            bars = ax.bar(xs, rates, width=width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize="x-small", padding=1)
        ax.set(
            xlabel="draft position",
            ylabel="acceptance rate (accepted / drafts)",
            ylim=(0, 1),
            xticks=list(range(1, kmax + 1)),
            title=name,
        )
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, report, "vLLM per-position acceptance", path)


def _comparison_lines(report: dict[str, Any], prompt_set: str) -> dict[str, list[tuple[int, Any, Any]]]:
    """{draft label: [(K, AL, speedup at the acceptance concurrency)] sorted by K} for one prompt set."""
    ac = report["settings"].get("acceptance_concurrency", 1)
    lines: dict[str, list[tuple[int, Any, Any]]] = {}
    for r in report["results"]:
        if r["prompt_set"] == prompt_set:
            point = (r["depths"], r["acceptance_length"], _at_acceptance(r, ac).get("speedup"))
            lines.setdefault(r.get("label") or r["draft"], []).append(point)
    return {k: sorted(v, key=lambda p: p[0]) for k, v in lines.items()}


def plot_comparison(report: dict[str, Any], path: str | Path) -> Path:
    """AL (top) and speedup (bottom) against K: one panel column per prompt set, one line per draft (its method in
    the legend); a draft measured at one K is a single marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [p["name"] for p in report["prompt_sets"]]
    methods = {d.get("label", d["name"]): d.get("method", "peagle") for d in report["drafts"]}
    fig, axes = plt.subplots(2, len(sets), figsize=(max(5.0, 4.5 * len(sets)), 6.5), dpi=110, squeeze=False)
    ks: set[int] = set()
    for col, name in enumerate(sets):
        for label, points in _comparison_lines(report, name).items():
            ks.update(p[0] for p in points)
            legend = f"{label} ({METHODS.get(methods.get(label, ''), '?')})"
            for row, index in ((0, 1), (1, 2)):
                xs = [p[0] for p in points if p[index] is not None]
                ys = [p[index] for p in points if p[index] is not None]
                axes[row][col].plot(xs, ys, marker="o", label=legend)
        axes[0][col].set(title=name, ylabel="acceptance length (vLLM)")
        axes[1][col].set(xlabel="K (num_speculative_tokens)", ylabel="speedup (draft / plain tokens/s)")
        axes[1][col].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        for row in (0, 1):
            axes[row][col].grid(alpha=0.3)
            axes[row][col].legend(fontsize="small")
    for ax in axes.flat:
        ax.set_xticks(sorted(ks) or [1])
    return _save(fig, report, "vLLM AL and speedup against K", path, f", {report['dtype']}")


def _save(fig: Any, report: dict[str, Any], title: str, path: str | Path, extra: str = "") -> Path:
    """Title `fig` with the run's settings (`extra` after the concurrency), write it to `path` and close it."""
    import matplotlib.pyplot as plt

    s = report["settings"]
    fig.suptitle(
        f"{title}: T={s['temperature']:g}, max {s['max_tokens']} new tokens, "
        f"concurrency {s.get('acceptance_concurrency', 1)}{extra}, {report['hardware']}",
        fontsize="small",
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
