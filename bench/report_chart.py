"""The benchmark report as a chart: each figure's distance from its goal (`make bench` writes OUT/report.png).

A figure's *margin* is how many times over its goal it lands, in the goal's own direction, so that 1.0 is the goal
line for every row and more is better:

    ">= 0.90x", measured 0.907  ->  0.907 / 0.90 = 1.008   (met, by 0.8 %)
    "<= 0.80x", measured 0.780  ->  0.80 / 0.780 = 1.026   (met)
    "< 5 %",    measured 0.0042 ->  0.05 / 0.0042 = 11.9   (met, by far)

Figures whose goal has no number ("loads; reported", "well above 1") are left out of the chart; the table keeps them.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["goal_margin", "write_chart"]

_GOAL = re.compile(r"^\s*(>=|<=|<|>)\s*([0-9.]+)\s*(x|%)?")


def goal_margin(value: float | None, goal: str) -> float | None:
    """Times over the goal in its direction (> 1: met); None where the goal has no number or the value is missing
    or not positive (no ratio to take).

    `goal` is the report's goal text: its first comparison counts (">= 1.0x, equal loss" -> >= 1.0); a `%` goal
    compares a fraction (`value` 0.004 is 0.4 %)."""
    m = _GOAL.match(goal)
    if value is None or m is None or not math.isfinite(value) or value <= 0:
        return None
    op, number, unit = m.groups()
    bound = float(number) / (100.0 if unit == "%" else 1.0)
    if bound <= 0:
        return None
    return value / bound if op.startswith(">") else bound / value


def write_chart(figures: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """A horizontal bar per figure with a numeric goal: its margin on a log axis, the goal line at 1; returns
    `path`, or None when no figure has a numeric goal (nothing is written then)."""
    rows = [(f, goal_margin(f.get("value"), f.get("goal", ""))) for f in figures]
    rows = [(f, m) for f, m in rows if m is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [_short(f["figure"]) for f, _ in rows]
    margins = [m for _, m in rows]
    colors = ["tab:green" if m >= 1.0 else "tab:red" for m in margins]
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 1.4))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [m - 1.0 for m in margins], left=1.0, color=colors)  # from the goal line, either way
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=1)
    for yi, (f, m) in zip(y, rows, strict=True):
        shown = f"{f['value'] * 100:.2f} %" if "%" in f["goal"] else f"{f['value']:.3f}x"
        ax.text(max(m, 1.0) * 1.04, yi, f"{shown} (goal {f['goal'].split(',')[0]})", va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel("times over the goal, in the goal's direction (1 = the goal line; log scale)")
    ax.set_xlim(min(0.2, min(margins) / 1.5), max(margins) * 6)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    _to_palette(path)
    return path


def _to_palette(path: Path, colors: int = 8) -> None:
    """Rewrite the PNG with a palette of `colors` colours: a chart of flat bars and text looks the same and takes
    about a quarter of the bytes of matplotlib's RGBA file (the report's chart is kept in the repository)."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as im:
        quantized = im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    quantized.save(path, optimize=True)


def _short(text: str, width: int = 50) -> str:
    """The figure's name in at most two lines of `width` characters (cut at a word, "..." where it goes on)."""
    lines = textwrap.wrap(text.replace("`", ""), width)
    return "\n".join(lines[:2]) + (" ..." if len(lines) > 2 else "")
