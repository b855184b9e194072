"""What the benchmark scripts share: the repository root, the demo assets they default to, and writing a result as
indented JSON (the files bench/run_all.py collects). Run every benchmark from the repository root as a module,
`python -m bench.bench_x`, so that `bench` and `peagle_pipeline` import without touching sys.path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The demo's model and data (`make demo-assets`, scripts/prepare_demo.py): every benchmark's default target and data.
DEMO_MODEL = ROOT / ".demo" / "models" / "SmolLM2-135M-Instruct"
DEMO_DATA = ROOT / ".demo" / "data" / "sharegpt.jsonl"


def write_result(out: str | Path | None, result: dict[str, Any]) -> None:
    """Write `result` to `out` as indented JSON with a final newline (parents created); nothing when `out` is None."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
