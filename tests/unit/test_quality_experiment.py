"""`make quality`'s own arithmetic (experiments/quality_sizing.py, quality_report.py, quality.py): the size `--scale auto`
picks for a host, the main run's steps from the minutes left, `--scale`'s parsing, the learning curve's log fit and
which records feed which cache. The run itself takes an hour (`make quality`)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

import quality  # noqa: E402
from quality_report import fit_log_curve  # noqa: E402
from quality_settings import BUDGET_MARGIN, BUDGET_MIN, REFERENCE, SCALE_RANGE, QualityError  # noqa: E402
from quality_sizing import main_steps_for, parse_scale, scale_for, size_main_run  # noqa: E402


def test_scale_fills_the_budget_at_the_reference_speed() -> None:
    got = scale_for(REFERENCE["probe_tokens_per_s"])
    assert got["scale"] == pytest.approx(1.232, abs=1e-3)
    assert got["predicted_min"] == pytest.approx(BUDGET_MIN * BUDGET_MARGIN, abs=0.1)


def test_a_slower_host_gets_less_data_in_the_same_minutes() -> None:
    slow = scale_for(REFERENCE["probe_tokens_per_s"] * 0.8)
    assert slow["scale"] < scale_for(REFERENCE["probe_tokens_per_s"])["scale"]
    assert slow["predicted_min"] == pytest.approx(BUDGET_MIN * BUDGET_MARGIN, abs=0.1)


def test_scale_stays_in_its_range_and_says_what_that_costs() -> None:
    fast = scale_for(3 * REFERENCE["probe_tokens_per_s"])  # the docstring's example: 3.0 fills 38.6 minutes
    assert fast["scale"] == SCALE_RANGE[1] and fast["predicted_min"] == pytest.approx(38.6, abs=0.05)
    crawl = scale_for(REFERENCE["probe_tokens_per_s"] / 10)
    assert crawl["scale"] == SCALE_RANGE[0] and crawl["predicted_min"] > BUDGET_MIN


def test_the_main_run_fills_the_minutes_left() -> None:
    got = main_steps_for(27 * 60, 0.33, 1017.0, 12)  # the docstring's example
    assert got["steps"] == 3384 and got["left_min"] == pytest.approx(20.5, abs=0.05)
    assert got["eval_predicted_min"] == pytest.approx(9.8, abs=0.05)
    # the run ends within the budget when its steps and the evaluation take what was predicted
    end_min = 27 + (got["steps"] * 0.33 + 75) / 60 + got["eval_predicted_min"]
    assert BUDGET_MIN - 5 < end_min < BUDGET_MIN
    later = main_steps_for(32 * 60, 0.33, 1017.0, 12)  # five more minutes spent: fewer steps, same multiple
    slower = main_steps_for(27 * 60, 0.40, 1017.0, 12)
    assert later["steps"] < got["steps"] and slower["steps"] < got["steps"]
    assert later["steps"] % 12 == 0 and slower["steps"] % 12 == 0
    nothing_left = main_steps_for(70 * 60, 0.33, 1017.0, 12)
    assert nothing_left["steps"] == 12  # one curve's worth of steps


def test_the_main_run_is_sized_once_from_the_rows_step_times(tmp_path: Path) -> None:
    rows = []
    for name, step_times in (("a", [0.30, 0.34, 0.90]), ("b", [0.32])):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        records = [{"kind": "train", "step": 25 * i, "step_time": t} for i, t in enumerate(step_times, 1)]
        records.append({"kind": "eval", "step": 25, "loss": 4.0})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        rows.append(run)
    sizing = {"probe_tokens_per_s": 1017.0}
    got = size_main_run(tmp_path, sizing, 27 * 60, rows, 12)
    assert got["step_s"] == pytest.approx(0.33)  # the median of 0.30, 0.32, 0.34, 0.90
    assert got == main_steps_for(27 * 60, 0.33, 1017.0, 12)
    # a re-run keeps the first sizing, whatever was spent since
    assert size_main_run(tmp_path, sizing, 50 * 60, rows, 12) == got
    with pytest.raises(QualityError, match="no step times"):
        size_main_run(tmp_path / "empty", sizing, 0.0, [tmp_path / "none"], 12)


@pytest.mark.parametrize("text", ["0", "-1", "half", ""])
def test_a_bad_scale_is_refused(text: str) -> None:
    with pytest.raises(QualityError, match="--scale must be"):
        parse_scale(text)


def test_scale_parses() -> None:
    assert parse_scale("auto") is None and parse_scale("0.2") == 0.2


def test_log_fit_recovers_an_exact_curve() -> None:
    points = [(t, 0.3 + 0.08 * math.log(t)) for t in (1e5, 1e6, 4e6)]
    fit = fit_log_curve(points)
    assert fit is not None
    assert fit["a"] == pytest.approx(0.3) and fit["b"] == pytest.approx(0.08)
    assert fit["tokens_for_1_6"] == pytest.approx(math.exp((1.6 - 0.3) / 0.08), rel=1e-9)
    assert fit["at_10x"] == pytest.approx(0.3 + 0.08 * math.log(4e7))


def test_log_fit_needs_two_measured_points() -> None:
    assert fit_log_curve([(1e6, 1.4), (2e6, None)]) is None
    assert fit_log_curve([(1e6, 1.4), (1e6, 1.41)]) is None  # one x: no slope


def _sharegpt(path: Path, n: int) -> None:
    """`n` one-exchange ShareGPT records: record i asks "question i"."""
    records = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}"},
                {"from": "gpt", "value": f"answer {i}"},
            ]
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_second_off_policy_cache_gets_the_next_records_and_never_held_out_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sharegpt(tmp_path / "sharegpt.jsonl", 40)
    monkeypatch.setattr(quality, "SHAREGPT", tmp_path / "sharegpt.jsonl")
    monkeypatch.setattr(quality, "HELDOUT_FIRST_RECORD", 30)
    train, more, heldout = quality.write_sources(tmp_path / "run", 8, 16, 5)
    questions = [json.loads(line)["conversations"][0]["value"] for line in train.read_text().splitlines()]
    assert questions == [f"question {i}" for i in range(8)]
    questions = [json.loads(line)["conversations"][0]["value"] for line in more.read_text().splitlines()]
    assert questions == [f"question {i}" for i in range(8, 24)]
    assert [json.loads(line)["prompt"] for line in heldout.read_text().splitlines()] == [
        f"question {i}" for i in range(30, 35)
    ]
    with pytest.raises(QualityError, match="held-out"):
        quality.write_sources(tmp_path / "too-many", 8, 23, 5)
