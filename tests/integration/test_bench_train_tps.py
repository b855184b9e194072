"""`python -m bench.bench_train_tps` on a real tiny cache: it times the trainer's own steps with a pipeline file's
settings, writes nothing beside the run, and a missing file or cache is one line and a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "bench.bench_train_tps"]  # run from the repository root, as docs/guides/train.md shows


def _config(path: Path, cache: Path) -> Path:
    path.write_text(
        "train:\n"
        f"  cache: {cache}\n"
        "  depths: 3\n"
        "  tokens_per_step: 256\n"
        "  draft_vocab_size: 300\n"
        "  precision: fp32\n"
        "  output: /nonexistent/never-written\n"
    )
    return path


def test_times_the_trainers_steps(tiny_cache: Path, tmp_path: Path) -> None:
    cfg = _config(tmp_path / "train.yaml", tiny_cache)
    out = tmp_path / "fig.json"
    cmd = [sys.executable, *SCRIPT, "-c", str(cfg), "--steps", "3", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fig = json.loads(out.read_text())
    assert fig["steps"] == 3 and fig["precision"] == "fp32"
    assert 3 * 100 < fig["tokens"] <= 3 * 256  # three packed rows of at most 256 tokens each
    assert fig["tokens_per_s"] > 0 and fig["seconds_per_step"] > 0
    assert "tokens/s" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.json", "train.yaml"]


def test_a_missing_cache_is_one_line(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "train.yaml", tmp_path / "no-cache")
    proc = subprocess.run(
        [sys.executable, *SCRIPT, "-c", str(cfg)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "no-cache" in lines[0]
    proc = subprocess.run(
        [sys.executable, *SCRIPT, "-c", str(tmp_path / "none.yaml")], cwd=REPO, capture_output=True, text=True
    )
    assert (
        proc.returncode == 2 and proc.stderr.strip() == f"error: no pipeline file at {tmp_path / 'none.yaml'}"
    )
