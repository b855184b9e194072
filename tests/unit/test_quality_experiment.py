"""`make quality`'s own arithmetic (experiments/quality_sizing.py, quality_report.py): the size `--scale auto` picks
for a host, `--scale`'s parsing and the learning curve's log fit. The run itself takes an hour (`make quality`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

from quality_report import fit_log_curve  # noqa: E402
from quality_settings import BUDGET_MARGIN, BUDGET_MIN, REFERENCE, SCALE_RANGE, QualityError  # noqa: E402
from quality_sizing import parse_scale, scale_for  # noqa: E402


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
