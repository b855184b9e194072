"""Metric sinks (jsonl + TensorBoard), resume truncation, and the PNG plots."""

from __future__ import annotations

import pytest

from peagle_pipeline.errors import BadInput
from peagle_pipeline.stages.train import metrics, trackers


def _records(sink, steps) -> None:
    for s in steps:
        sink.log({"step": s, "kind": "train", "loss": 3.0 / s, "agreement": [0.5, 0.2 + 0.01 * s, None]})
        if s % 2 == 0:
            sink.log(
                {
                    "step": s,
                    "kind": "eval",
                    "loss": 2.0 / s,
                    "agreement": [0.6, 0.3, 0.1],
                    "acceptance": 1.0 + 0.1 * s,
                }
            )


def test_jsonl_tensorboard_and_resume_truncation(tmp_path) -> None:
    tb = trackers.open_trackers(
        ["tensorboard"], trackers.TrackerRun(tmp_path, 0, {"train": {}}, resumed=False)
    )
    sink = metrics.RunSink(tmp_path, total_steps=6, progress_bar=False, trackers=tb)
    _records(sink, range(1, 7))
    sink.close()
    assert len(metrics.read_metrics(tmp_path)) == 9
    assert any((tmp_path / "tb").iterdir())
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "kind": "tra')  # torn line of a killed run
    resumed = metrics.RunSink(tmp_path, total_steps=6, start_step=4, progress_bar=False)
    resumed.close()
    recs = metrics.read_metrics(tmp_path)
    assert max(r["step"] for r in recs) == 4 and len(recs) == 6


def test_plot_writes_three_pngs(tmp_path) -> None:
    sink = metrics.RunSink(tmp_path, total_steps=6, progress_bar=False)
    _records(sink, range(1, 7))
    sink.close()
    paths = metrics.plot(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "agreement.png", "acceptance.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plot_without_metrics(tmp_path) -> None:
    with pytest.raises(BadInput, match="train first"):
        metrics.plot(tmp_path)


def test_non_finite_values_are_strict_json(tmp_path) -> None:
    """json.dumps writes NaN/Infinity, which jq and strict parsers refuse: they become null plus a flag."""
    import json

    sink = metrics.RunSink(tmp_path, total_steps=2, progress_bar=False)
    sink.log(
        {
            "step": 1,
            "kind": "train",
            "loss": float("nan"),
            "grad_norm": float("inf"),
            "agreement": [0.5, float("-inf")],
        }
    )
    sink.close()

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    line = (tmp_path / "metrics.jsonl").read_text().strip()
    rec = json.loads(line, parse_constant=refuse)
    assert rec["loss"] is None and rec["grad_norm"] is None and rec["agreement"] == [0.5, None]
    assert rec["nonfinite"] == ["agreement", "grad_norm", "loss"]


def test_skipped_steps_are_not_a_loss_of_zero() -> None:
    window = metrics.StepWindow(2)
    for _ in range(3):  # no update happened: the loss is unknown, not 0.0
        window.add(
            metrics.StepStats(loss_sum=float("nan"), count=40, correct=[1, 1], total=[4, 4], skipped=True),
            0.0,
            0.1,
        )
    rec = window.record(3, 1e-3, 0)
    assert rec["loss"] is None and rec["skipped_steps"] == 3 and rec["agreement"] == [None, None]
    window.add(metrics.StepStats(loss_sum=8.0, count=4, correct=[2, 1], total=[4, 4]), 0.0, 0.1)
    rec = window.record(4, 1e-3, 0)
    assert rec["loss"] == 2.0 and rec["skipped_steps"] == 3 and rec["agreement"] == [0.5, 0.25]


def test_plot_skips_windows_without_a_loss(tmp_path) -> None:
    sink = metrics.RunSink(tmp_path, total_steps=3, progress_bar=False)
    sink.log({"step": 1, "kind": "train", "loss": 2.0, "agreement": [0.5]})
    sink.log({"step": 2, "kind": "train", "loss": None, "skipped_steps": 1, "agreement": [None]})
    sink.close()
    assert [p.name for p in metrics.plot(tmp_path)] == ["loss.png", "agreement.png", "acceptance.png"]


def test_plain_progress_lines_when_there_is_no_terminal(tmp_path, capsys) -> None:
    sink = metrics.RunSink(tmp_path, total_steps=3)  # stderr is captured: not a terminal
    for step in (1, 2, 3):
        sink.log({"step": step, "kind": "train", "loss": 1.5, "lr": 1e-3, "tokens_per_s": 100.0})
    sink.log({"step": 3, "kind": "eval", "loss": 1.4, "acceptance": 1.25, "agreement": [0.5, None]})
    sink.log(
        {
            "step": 3,
            "kind": "eval",
            "loss": 1.4,
            "acceptance": 1.25,
            "acceptance_walk": 1.2,
            "agreement": [0.5],
        }
    )
    sink.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("step 1/3 (33%): loss 1.5000, lr 0.001, 100 tok/s")
    assert lines[1].startswith("step 3/3 (100%)")  # step 2 came within LINE_EVERY_S of step 1
    assert lines[2] == "eval at step 3: loss 1.4000, acceptance length 1.250, agreement per depth [0.50 -]"
    assert lines[3] == (
        "eval at step 3: loss 1.4000, acceptance length 1.250 (vLLM's walk 1.200), agreement per depth [0.50]"
    )


def test_plot_parts_draw_what_the_records_hold() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [
        {"kind": "train", "step": 5, "loss": 2.0, "agreement": [0.1, 0.05]},
        {"kind": "train", "step": 10, "loss": None, "skipped_steps": 5},  # every step of the window skipped
        {"kind": "train", "step": 15, "loss": 1.5, "skipped_steps": 1},
    ]
    evals = [
        {"kind": "eval", "step": 10, "loss": 1.8, "agreement": [0.5, 0.4], "acceptance": 1.9},
        {"kind": "eval", "step": 15, "loss": None, "agreement": [0.6, None], "acceptance": None},
    ]
    fig, ax = plt.subplots()
    metrics._plot_loss(ax, train, evals)
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["train"].get_xdata()) == [5, 15] and list(lines["held-out"].get_xdata()) == [10]
    assert [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_color() == "tab:red"] == [10, 15]
    fig, ax = plt.subplots()
    metrics._plot_agreement(ax, train, evals)
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert sorted(lines) == ["depth 0", "depth 1"] and list(lines["depth 1"].get_ydata()) == [0.4]
    assert "held-out" in ax.get_title()
    fig, ax = plt.subplots()
    metrics._plot_agreement(ax, train, [])  # no evaluation yet: the train windows
    assert "train" in ax.get_title() and len(ax.get_lines()) == 2
    fig, ax = plt.subplots()
    metrics._plot_acceptance(ax, evals)
    assert [list(ln.get_ydata()) for ln in ax.get_lines()][0] == [1.9]
    plt.close("all")
