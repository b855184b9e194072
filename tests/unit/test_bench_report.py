"""`make bench`'s driver (bench/run_all.py): its benchmark list loads, and the report renders from whatever results
exist, including none and the demo's evaluation report. No benchmark script runs here (they take minutes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench.run_all, its demo directory pointed at an empty tmp dir."""
    from bench import run_all as mod

    monkeypatch.setattr(mod, "DEMO", tmp_path / "demo")
    return mod


def test_unknown_benchmark_is_one_line_error_listing_all(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--out", str(tmp_path), "--only", "nosuch"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "nosuch" in lines[0]
    for name in ("extract", "cache", "step", "speculators", "generate", "fp8", "data_wait"):
        assert f"'{name}'" in lines[0]


def test_every_benchmark_entry_is_a_bench(run_all: ModuleType) -> None:
    names = [b.name for b in run_all.BENCHES]
    assert all(isinstance(b, run_all.Bench) for b in run_all.BENCHES)
    assert len(names) == len(set(names))
    for b in run_all.BENCHES:
        assert (REPO / "bench" / b.script).is_file(), b.script


def test_report_with_no_results_says_not_measured(run_all: ModuleType, tmp_path: Path) -> None:
    figs = run_all.figures(tmp_path)
    assert figs and all(f["met"] is None and f["value"] is None for f in figs)
    assert all("not measured" in f["measured"] for f in figs)
    meta = {
        "command": "make bench",
        "date": "2026-01-01 00:00",
        "machine": "2 CPU cores",
        "python": "3.11",
        "torch": "2.13.0",
        "load_avg_start": 0.1,
        "load_avg_end": 0.2,
        "quick": False,
    }
    for b in run_all.BENCHES:
        b.ran = {"status": "skipped (--only)"}
    report = run_all.render(figs, meta, run_all.BENCHES)
    for b in run_all.BENCHES:
        assert b.script in report
    assert report.count("not measured") >= len(figs)
    (tmp_path / "report.png").write_bytes(b"an older run's chart")
    written = run_all.write_report(tmp_path, meta, tmp_path / "no-demo")
    assert "report.png" not in written and not (tmp_path / "report.png").exists()  # nothing to draw: no chart


def test_demo_row_reads_the_demo_evaluation_report(run_all: ModuleType) -> None:
    row = {
        "prompt_set": "mt-bench",
        "acceptance_length": 1.25,
        "acceptance_per_position": [0.2, 0.04, 0.01, 0.0],
        "prompts": 80,
        "max_tokens": 64,
        "depths": 4,
        "temperature": 0.0,
        "trainer_estimate": 1.31,
        "identical": False,
        "mismatched_prompts": 3,
        "throughput": [{"speedup": 0.45, "concurrency": 16}],
    }
    held_out = dict(row, prompt_set="heldout", acceptance_length=9.0)
    (run_all.DEMO / "eval").mkdir(parents=True)
    (run_all.DEMO / "eval" / "report.json").write_text(json.dumps({"results": [held_out, row]}))
    (vllm,) = [f for f in run_all.demo_figures() if f["source"] == "make demo (evaluate)"]
    assert vllm["value"] == 1.25 and vllm["met"] is True
    text = vllm["measured"]
    assert "1.250" in text and "0.20 / 0.04 / 0.01 / 0.00" in text and "trainer estimate 1.310" in text
    assert "0.45x" in text and "3 of 80 prompts" in text


def test_the_report_quotes_the_demo_directory_it_is_given(run_all: ModuleType, tmp_path: Path) -> None:
    other = tmp_path / ".demo-fp32"  # `make bench DEMO_DIR=.demo-fp32`
    (other / "eval").mkdir(parents=True)
    row = {"prompt_set": "mt-bench", "acceptance_length": 1.27, "acceptance_per_position": [0.25, 0.02, 0, 0]}
    row |= {"prompts": 80, "max_tokens": 64, "depths": 4, "temperature": 0.0, "identical": True}
    (other / "eval" / "report.json").write_text(json.dumps({"results": [row]}))
    (vllm,) = [f for f in run_all.demo_figures(other) if f["source"].endswith("(evaluate)")]
    assert vllm["value"] == 1.27 and vllm["source"] == "make demo DEMO_DIR=.demo-fp32 (evaluate)"
    assert "identical to plain decoding" in vllm["measured"]
    (default,) = [f for f in run_all.demo_figures() if f["source"].endswith("(evaluate)")]
    assert default["value"] is None and default["source"] == "make demo (evaluate)"  # nothing in DEMO


def test_render_rewrites_the_report_from_the_results_and_the_recorded_run(
    run_all: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results"
    out.mkdir()
    meta = {"command": "make bench", "date": "2026-11-27 04:48", "machine": "2 CPU cores", "python": "3.11"}
    meta |= {"torch": "2.13.0", "load_avg_start": 0.8, "load_avg_end": 2.2, "quick": False, "seconds": 900.0}
    extract = {"ratio": 0.91, "extract_tokens_per_s": 579.0, "bare_tokens_per_s": 636.0, "tokens": 21325}
    extract |= {"rounds": 3, "round_ratios": [0.944, 0.881, 0.894]}
    (out / "extract.json").write_text(json.dumps(extract))
    ran = {"status": "ok", "seconds": 230.1, "command": "python -m bench.bench_extract --rounds 3"}
    (out / "report.json").write_text(json.dumps({"meta": meta, "scripts": {"extract": ran}}))
    assert run_all.main(["--out", str(out), "--render"]) == 0
    report = (out / "report.md").read_text()
    assert "`make bench` started 2026-11-27 04:48, ran 15.0 min: 2 CPU cores" in report
    assert "0.910x (579 vs 636 tokens/s, 21325 tokens x 3 rounds: 0.944x / 0.881x / 0.894x)" in report
    assert "| bench_extract.py | ok | 230.1 |" in report
    assert "| bench_cache.py | not run |" in report  # a script the recorded run did not run
    assert "![each figure against its goal](report.png)" in report
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart, from the one figure
    saved = json.loads((out / "report.json").read_text())
    assert saved["meta"] == meta and saved["scripts"]["extract"] == ran
    capsys.readouterr()
    assert run_all.main(["--out", str(tmp_path / "nothing"), "--render"]) == 2  # no recorded run: one line
    assert "cannot re-write the report" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "goal", "margin"),
    [
        (0.907, ">= 0.90x", 0.907 / 0.90),
        (0.78, "<= 0.80x, aux bit-exact", 0.80 / 0.78),
        (0.0042, "< 5 %", 0.05 / 0.0042),
        (0.41, ">= 1.0x", 0.41),
        (2.52, ">= 2.5x lower", 2.52 / 2.5),
    ],
)
def test_goal_margin_is_times_over_the_goal_in_its_direction(value: float, goal: str, margin: float) -> None:
    from bench.report_chart import goal_margin

    assert goal_margin(value, goal) == pytest.approx(margin)


@pytest.mark.parametrize(("value", "goal"), [(1.27, "loads; reported"), (None, ">= 1.0x"), (0.0, "< 5 %")])
def test_a_goal_or_value_without_a_number_has_no_margin(value: float | None, goal: str) -> None:
    from bench.report_chart import goal_margin

    assert goal_margin(value, goal) is None


def test_no_chart_without_a_numeric_goal(tmp_path: Path) -> None:
    from bench.report_chart import write_chart

    figure = {"figure": "Demo", "goal": "loads; reported", "value": 1.27}
    assert write_chart([figure], tmp_path / "c.png", "t") is None and not (tmp_path / "c.png").exists()


def test_the_vllm_extraction_ceiling_is_the_bare_prefills_share_of_the_matmul_work() -> None:
    from bench.bench_vllm_extract import matmul_ceiling

    cfg = {
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    # a layer: projections 8 x 4 x (2 x 2 + 2 x 1) = 192, MLP 3 x 8 x 16 = 384, attention 2 x 2 x 4 x 10 = 160
    assert matmul_ceiling(cfg, 10) == pytest.approx(2 * 736 / (2 * 736 + 8 * 100))
    assert matmul_ceiling({**cfg, "num_experts": 8}, 10) is None


@pytest.mark.parametrize("capped", [False, True])
def test_the_dtype_row_says_when_its_time_cap_cut_it_short(
    run_all: ModuleType, tmp_path: Path, capped: bool
) -> None:
    """On a CPU without bf16 units bench_dtype stops each path at its time cap: the row says over what it measured."""
    result = {
        "chosen": "fp32",
        "cpu_bf16_flags": [],
        "extract_ratio": 40.0,
        "train_ratio": 35.0,
        "extract_tokens_per_s": {"bf16": 10.0, "fp32": 400.0},
        "train_tokens_per_s": {"bf16": 20.0, "fp32": 700.0},
        "extract_batches_measured": "1 of 3" if capped else "3 of 3",
        "train_steps_measured": 0 if capped else 3,
        "time_capped": capped,
    }
    (tmp_path / "dtype.json").write_text(json.dumps(result))
    row = next(f for f in run_all.figures(tmp_path) if f["source"] == "bench_dtype")
    assert row["met"] is True and "auto = fp32 (no bf16 units)" in row["measured"]
    assert ("time-capped: 1 of 3 extraction batches, 0 training steps" in row["measured"]) == capped


def test_loader_rows_read_bench_loader(run_all: ModuleType, tmp_path: Path) -> None:
    result = {"tokens_per_s_per_core": {"bf16": 150000.0, "fp8": 30000.0, "nf4": 100000.0}}
    result |= {"need_tokens_per_s": 300000, "nf4_aux_vs_bf16": 0.283, "nf4_vs_bf16": 0.33}
    result |= {"aux_bytes_per_token": {"bf16": 3460.0, "nf4": 979.0}, "goals": {"nf4_aux_vs_bf16_max": 0.30}}
    (tmp_path / "loader.json").write_text(json.dumps(result))
    speed, size = run_all.loader_figures(tmp_path)
    assert speed["value"] == 30000.0 and "nf4 100,000 tokens/s (3.0 cores)" in speed["measured"]
    assert size["value"] == 0.283 and size["met"] is True and "979 vs 3460" in size["measured"]
