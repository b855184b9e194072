"""Shared by the benchmark scripts: write a result as indented JSON (the files bench/run_all.py collects)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(out: str | Path | None, result: dict[str, Any]) -> None:
    """Write `result` to `out` as indented JSON with a final newline (parents created); nothing when `out` is None."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
