"""Optimizer and schedule: the learning rate is a pure function of the step."""

from __future__ import annotations

import pytest

from peagle_pipeline.stages.optim import lr_at


def test_warmup_then_cosine() -> None:
    got = [lr_at(s, 1.0, 2, 6, "cosine") for s in range(6)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447], abs=1e-6)


def test_linear_and_constant() -> None:
    assert [lr_at(s, 2.0, 0, 4, "linear") for s in range(4)] == pytest.approx([2.0, 1.5, 1.0, 0.5])
    assert {lr_at(s, 2.0, 3, 10, "constant") for s in range(3, 10)} == {2.0}
    assert lr_at(50, 1.0, 2, 10, "cosine") == pytest.approx(0.0)  # past the end (steps extended): stays at 0
