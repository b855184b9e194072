"""Metric sinks (jsonl + TensorBoard), resume truncation, and the PNG plots."""

from __future__ import annotations

import pytest

from peagle_pipeline.errors import BadInput
from peagle_pipeline.stages import metrics


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
    sink = metrics.RunSink(tmp_path, total_steps=6, progress_bar=False)
    _records(sink, range(1, 7))
    sink.close()
    assert len(metrics.read_metrics(tmp_path)) == 9
    assert any((tmp_path / "tb").iterdir())
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "kind": "tra')  # torn line of a killed run
    resumed = metrics.RunSink(tmp_path, total_steps=6, start_step=4, progress_bar=False, tensorboard=False)
    resumed.close()
    recs = metrics.read_metrics(tmp_path)
    assert max(r["step"] for r in recs) == 4 and len(recs) == 6


def test_plot_writes_three_pngs(tmp_path) -> None:
    sink = metrics.RunSink(tmp_path, total_steps=6, progress_bar=False, tensorboard=False)
    _records(sink, range(1, 7))
    sink.close()
    paths = metrics.plot(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "agreement.png", "acceptance.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plot_without_metrics(tmp_path) -> None:
    with pytest.raises(BadInput, match="train first"):
        metrics.plot(tmp_path)
