"""A training run folder's records read back, for every command that reads a run (train on resume, export's
card, evaluate's draft list): its metrics (`read_metrics`, metrics.jsonl) and its identity (`run_identity`, the
path and first start time from run.json). Reads only; train writes both. The names come from `run_layout`.

Example: a run killed mid-line keeps its complete records; the torn last line is dropped.

    >>> import pathlib, tempfile
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (run / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\\n{"step": 2, "ki')
    >>> read_metrics(run)
    [{'step': 1, 'kind': 'train'}]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peagle_pipeline.stages.run_layout import METRICS_FILE, RUN_JSON

__all__ = ["read_metrics", "run_identity"]


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete records of a run's metrics.jsonl (a torn last line, from a kill, is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def run_identity(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Who an export comes from: the run's path and the time of its first start (from run.json).

    The start time survives moving or copying the run folder; the path names it for people.
    """
    try:
        starts = json.loads((Path(run_dir) / RUN_JSON).read_text()).get("starts") or [{}]
        started = starts[0].get("time")
    except (OSError, ValueError, AttributeError):
        started = None
    return {"run": str(Path(run_dir).resolve()), "run_started": started}
