"""`make compare`'s own arithmetic and report (experiments/compare_settings.py, compare_report.py): equal training
time per row, the rows a package without a method or layer style skips, the noise figure, the goals and the doc.
The run itself takes an hour (`make compare`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

import compare  # noqa: E402
from compare_report import render_doc, results_dir_name, summarize  # noqa: E402
from compare_settings import (  # noqa: E402
    BUDGET_MARGIN,
    BUDGET_MIN,
    CALIBRATION_STEPS,
    DEFAULT_ROWS,
    FINISH_MARGIN_MIN,
    ROW_OVERHEAD_S,
    CompareError,
    eval_minutes,
    median_step_s,
    row_flags,
    row_steps,
    scale_for,
    timed_as,
    trainable,
)

EVERYTHING = {"method": ["peagle", "eagle3"], "draft_arch": ["auto", "llama", "qwen3"]}


def test_every_row_trains_for_the_same_seconds_and_the_run_ends_in_the_hour() -> None:
    got = row_steps({"a": 0.3, "b": 0.6}, 12 * 60, 12.0)  # the docstring's example
    assert got["steps"] == {"a": 2980, "b": 1490} and got["train_s_per_row"] == pytest.approx(894.0)
    step_s = {"peagle-llama": 0.31, "peagle-qwen3": 0.33, "eagle3-llama": 0.95, "peagle-llama-seed1": 0.31}
    spent, eval_min = 14 * 60, 13.0
    plan = row_steps(step_s, spent, eval_min)
    seconds = [plan["steps"][k] * s for k, s in step_s.items()]
    assert max(seconds) - min(seconds) < max(step_s.values())  # equal up to one step
    end_min = (spent + sum(seconds) + ROW_OVERHEAD_S * len(step_s)) / 60 + eval_min
    assert BUDGET_MIN * BUDGET_MARGIN - FINISH_MARGIN_MIN - 1 < end_min <= BUDGET_MIN * BUDGET_MARGIN
    assert row_steps(step_s, 70 * 60, eval_min)["steps"] == dict.fromkeys(
        step_s, CALIBRATION_STEPS
    )  # none left


def test_the_second_run_of_a_row_trains_its_rows_steps() -> None:
    # the noise figure is two runs that differ in the seed alone: the repeat takes its row's timed steps
    assert timed_as("peagle-llama-seed1", list(DEFAULT_ROWS)) == "peagle-llama"
    assert timed_as("peagle-llama", list(DEFAULT_ROWS)) == "peagle-llama"
    # without its row the repeat is timed itself (it is then skipped anyway, but never keyed to a missing row)
    assert timed_as("peagle-llama-seed1", ["peagle-llama-seed1"]) == "peagle-llama-seed1"


def test_the_evaluation_and_the_data_follow_the_hosts_speed() -> None:
    sizes = {"mtbench_prompts": 80, "humaneval_prompts": 164, "speed_prompts": 24}
    at_reference = eval_minutes(4, sizes, 976.0)
    assert at_reference == pytest.approx(5 * 244 * 7.1 / 960 + 5 * 24 * 2.2 / 80)
    assert eval_minutes(4, sizes, 488.0) == pytest.approx(
        2 * at_reference
    )  # half the speed, twice the minutes
    assert (
        scale_for(976.0) == 1.0
        and scale_for(488.0) == 0.5
        and scale_for(100.0) == 0.3
        and scale_for(1e5) == 3.0
    )


def test_a_package_without_a_method_or_style_skips_its_rows_in_one_line() -> None:
    rows = list(DEFAULT_ROWS)
    assert trainable(rows, EVERYTHING) == (rows, [])
    keep, skipped = trainable(rows, {"draft_arch": ["auto", "llama", "qwen3"]})  # no `method`: P-EAGLE only
    assert keep == ["peagle-llama", "peagle-qwen3", "peagle-llama-seed1"]
    assert skipped == ["skipped eagle3-llama: this package's `train` has no --method eagle3"]
    keep, skipped = trainable(["peagle-qwen3", "eagle3-qwen3", "peagle-llama-seed1"], {})
    assert keep == []
    assert skipped == [
        "skipped peagle-qwen3: this package's `train` has no --draft-arch qwen3",
        "skipped eagle3-qwen3: this package's `train` has no --method eagle3 or --draft-arch qwen3",
        "skipped peagle-llama-seed1: it repeats peagle-llama, which does not run",
    ]


def test_a_row_gets_only_the_settings_the_package_has() -> None:
    assert row_flags("eagle3-llama", EVERYTHING)["method"] == "eagle3"
    assert row_flags("peagle-qwen3", EVERYTHING)["draft_arch"] == "qwen3"
    old = row_flags("peagle-llama", {})
    assert "method" not in old and "draft_arch" not in old and old["depths"] == 4
    assert row_flags("peagle-llama-seed1", EVERYTHING)["seed"] == 1 and "seed" not in row_flags(
        "peagle-llama", {}
    )


def test_unknown_rows_are_one_line() -> None:
    with pytest.raises(CompareError, match="unknown row\\(s\\) eagle2; rows are peagle-llama"):
        compare._rows("peagle-llama,eagle2")


def test_step_time_is_the_median_of_the_logged_steps(tmp_path: Path) -> None:
    records = [{"kind": "train", "step": i, "step_time": t} for i, t in enumerate([0.9, 0.3, 0.32, 0.31], 1)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [*records, {"kind": "eval"}])
    )
    assert median_step_s(tmp_path) == pytest.approx(0.315)
    assert median_step_s(tmp_path / "none") is None


def _result(draft: str, prompt_set: str, al: float, per: list[float], speedup: float = 0.5) -> dict:
    return {
        "draft": draft, "prompt_set": prompt_set, "acceptance_length": al, "acceptance_per_position": per,
        "trainer_estimate": al + 0.05, "identical": True,
        "throughput": [{"speedup": speedup, "tokens_per_s": 20.0 * speedup, "plain_tokens_per_s": 20.0}],
    }  # fmt: skip


def test_the_summary_and_doc_say_the_noise_and_by_how_much_a_goal_is_missed(tmp_path: Path) -> None:
    als = {"peagle-llama": 1.50, "peagle-qwen3": 1.56, "eagle3-llama": 1.70, "peagle-llama-seed1": 1.52}
    runs = {name: tmp_path / "runs" / name for name in als}
    report = {
        "dtype": "bf16",
        "results": [
            _result(f"{n}/export", s, al + (0.1 if s == "humaneval" else 0.0), [al - 1, 0.1, 0.0, 0.0])
            for n, al in als.items()
            for s in ("mt-bench", "humaneval")
        ],
    }
    speed = {
        "results": [
            _result(f"{n}/export", "mt-bench", al, [al - 1], speedup=al - 0.2) for n, al in als.items()
        ]
    }
    plan = {"train_s_per_row": 480.0, "steps": dict.fromkeys(als, 1500), "step_s": dict.fromkeys(als, 0.32)}
    times = {"train: peagle-llama": 500.0, "evaluate: every row": 700.0}
    settings = {"source_conversations": 900, "max_length": 384, "eval_max_tokens": 64, "speed_prompts": 24,
                "hardware": "AMD EPYC 9B14, 2 cores", "bf16_units": ["avx512_bf16"], "skipped": []}  # fmt: skip
    summary = summarize(runs, report, speed, plan, times, settings)
    json.dumps(summary, allow_nan=False)
    rows = {r["name"]: r for r in summary["rows"]}
    assert rows["eagle3-llama"]["mtbench_al"] == 1.70 and rows["eagle3-llama"][
        "humaneval_al"
    ] == pytest.approx(1.8)
    assert (
        rows["eagle3-llama"]["speedup"] == pytest.approx(1.5)
        and rows["peagle-llama"]["train_tokens"] == 1500 * 1024
    )
    assert summary["noise"] == [
        {"row": "peagle-llama", "repeat": "peagle-llama-seed1", "mtbench_al": 0.02, "humaneval_al": 0.02}
    ]
    best, peagle = summary["goals"]
    assert (best["row"], best["met"], best["short_by"]) == ("eagle3-llama", False, pytest.approx(0.1))
    assert (peagle["row"], peagle["met"], peagle["short_by"]) == ("peagle-qwen3", True, 0.0)
    assert summary["total_s"] == 1200.0
    summary["finished_utc"] = "2026-12-02 03:10 UTC"
    assert results_dir_name(summary) == "compare-amd-2026-12-02"
    summary["raw_output"] = "bench/results/compare-amd-2026-12-02"
    doc = render_doc(summary, Path(__file__).resolve().parents[2] / "docs" / "results" / "compare.md")
    assert "](../../bench/results/compare-amd-2026-12-02)" in doc and "Command: `make compare`" in doc
    assert "| eagle3-llama | EAGLE-3 | Llama | 1,500 (1,536,000) | 1.700 | 0.70 / 0.10 / 0.00 / 0.00 |" in doc
    assert "noise (two runs of one row, peagle-llama and peagle-llama-seed1): MT-Bench AL +0.020" in doc
    assert "goal 1.8 **missed by 0.100**; per position 0.70 / 0.10 / 0.00 / 0.00" in doc
    assert "the best P-EAGLE draft (peagle-qwen3): MT-Bench AL 1.560, goal 1.55 met" in doc
    assert "AMD EPYC 9B14, 2 cores, bf16 units: avx512_bf16" in doc and "2026-12-02 03:10 UTC" in doc
