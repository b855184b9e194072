"""experiments/draft_on_cache.py on a real tiny run and real caches: its estimate is the trainer's own held-out estimate
on the same samples, its copy split adds up, and a user mistake is one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import peagle

from peagle_pipeline.cli import main
from peagle_pipeline.config import TrainConfig, resolve
from peagle_pipeline.stages.train.distributed import Dist
from peagle_pipeline.stages.train.trainer import Trainer

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "draft_on_cache.py"
SHORT = [
    *("--depths", "3", "--tokens-per-step", "256", "--steps", "3", "--eval-every", "3", "--save-every", "3"),
    *("--eval-samples", "6", "--precision", "fp32", "--num-workers", "0", "--draft-vocab-size", "300"),
    "--no-export",
]


def _script_module():
    spec = importlib.util.spec_from_file_location("draft_on_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def run(tiny_cache: Path, other_tiny_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    argv = ["train", "--cache", str(tiny_cache), "--output", str(out), *SHORT]
    assert main([*argv, "--eval-cache", str(other_tiny_cache)]) == 0
    return out


def test_the_estimate_is_the_trainers_own_on_the_same_samples(run: Path) -> None:
    trainer = Trainer(resolve(TrainConfig, run / "train.yaml"), Dist.setup("cpu"))
    assert trainer.restore()
    own = trainer.evaluate()
    fig = _script_module().measure(trainer)  # the run's held-out samples, as `evaluate` reads them
    assert own is not None and fig["samples"] == own["eval_samples"] == 6
    assert fig["acceptance"] == pytest.approx(own["acceptance"], abs=1e-9)
    assert own["acceptance_walk"] is not None and fig["acceptance_walk"] == pytest.approx(
        own["acceptance_walk"]
    )
    assert fig["agreement"] == pytest.approx(own["agreement"])
    split = fig["by_copy_rule"]
    assert sum(c["share"] for c in split.values()) == pytest.approx(1.0)
    weighted = sum(c["share"] * c["acceptance"] for c in split.values() if c["acceptance"] is not None)
    assert weighted == pytest.approx(fig["acceptance"])
    # the trainer's own held-out record carries the copy figures too (metrics.jsonl), and they agree
    assert own["copy_share"] == pytest.approx(split["copy right"]["share"]) and own["copy_share"] > 0
    assert own["copy_agreement"] == pytest.approx(split["copy right"]["depth0_agreement"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "eval"][-1]
    assert last["copy_share"] == pytest.approx(own["copy_share"])


def test_fewer_served_depths_count_only_the_first_ones(
    run: Path, other_tiny_cache: Path, tmp_path: Path
) -> None:
    """`--depths K` measures the K = 3 draft as vLLM serving fewer tokens would: with one depth the estimate is
    1 + depth-0 agreement, and neither the estimate nor the walk grows when depths are taken away."""
    trainer = Trainer(resolve(TrainConfig, run / "train.yaml"), Dist.setup("cpu"))
    assert trainer.restore()
    module = _script_module()
    full, two, one = (module.measure(trainer, k) for k in (None, 2, 1))
    assert (full["depths"], two["depths"], one["depths"]) == (3, 2, 1)
    assert one["acceptance"] == pytest.approx(1 + full["agreement"][0])
    assert one["acceptance"] <= two["acceptance"] <= full["acceptance"]
    assert one["acceptance_walk"] <= two["acceptance_walk"] <= full["acceptance_walk"]
    assert two["agreement"] == full["agreement"]  # agreement stays per trained depth
    cmd = [sys.executable, str(SCRIPT), str(run), str(other_tiny_cache)]
    proc = subprocess.run([*cmd, "--depths", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "K 2 of 3" in proc.stdout, proc.stderr
    bad = subprocess.run([*cmd, "--depths", "4"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --depths 4: the draft was trained at K = 3"


def test_the_script_holds_out_every_sample_of_the_cache(
    run: Path, other_tiny_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "fig.json"
    cmd = [sys.executable, str(SCRIPT), str(run), str(other_tiny_cache), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fig = json.loads(out.read_text())
    assert fig["samples"] == 24 and fig["step"] == 3 and fig["anchors"] > 0
    printed = (
        f"estimated acceptance length {fig['acceptance']:.3f} (vLLM's walk {fig['acceptance_walk']:.3f})"
    )
    assert printed in proc.stdout
    assert all(name in proc.stdout for name in ("copy right", "copy wrong", "no copy guess"))
    first = subprocess.run([*cmd[:4], "--samples", "5"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "5 samples" in first.stdout


def test_a_cache_where_the_copy_rule_never_guesses_prints_dashes(
    run: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """Replies of words the context never spells out: the copy-right and copy-wrong classes have no anchors."""
    data = tmp_path / "plain.jsonl"
    turns = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the quick brown fox"},
    ]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    cache = tmp_path / "cache"
    argv = ["--dtype", "fp32", "--max-length", "256", "--shard-tokens", "2048", "--chunk-tokens", "256"]
    peagle("extract", "--model", str(tiny_model), "--data", str(data), "--output", str(cache), *argv)
    out = tmp_path / "fig.json"
    cmd = [sys.executable, str(SCRIPT), str(run), str(cache), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    split = json.loads(out.read_text())["by_copy_rule"]
    assert split["copy right"]["acceptance"] is None and split["no copy guess"]["share"] == 1.0
    row = next(line for line in proc.stdout.splitlines() if line.startswith("copy right"))
    assert row.split()[-2:] == ["-", "-"], proc.stdout


def test_a_missing_run_is_one_line(tmp_path: Path, other_tiny_cache: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "nope"), str(other_tiny_cache)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "train.yaml" in lines[0], proc.stderr
