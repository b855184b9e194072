"""A training step copies its metrics to the host once, not once per segment (each copy of a device
tensor to the host waits for the GPU); counted here on CPU by the calls the step makes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_pipeline.config import TrainConfig, resolve
from peagle_pipeline.core import loss
from peagle_pipeline.stages.train.distributed import Dist
from peagle_pipeline.stages.train.loader import Cursor
from peagle_pipeline.stages.train.trainer import Trainer

pytestmark = pytest.mark.slow


def test_a_step_of_four_segments_copies_its_metrics_to_the_host_once(
    tiny_cache: Path, tmp_path: Path, monkeypatch
) -> None:
    cfg = resolve(
        TrainConfig,
        None,
        {
            "cache": str(tiny_cache),
            "output": str(tmp_path / "run"),
            "depths": 4,
            "tokens_per_step": 200,
            "precision": "fp32",
            "sequence_partitions": 4,
            "eval_samples": 0,
            "num_workers": 0,
        },
    )
    trainer = Trainer(cfg, Dist())
    (_, micro) = next(trainer.loader.iterate(Cursor()))
    copies: list[tuple[int, ...]] = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        copies.append(tuple(self.shape))
        return real_cpu(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    stats = trainer.train_step(micro)
    monkeypatch.undo()
    assert not stats.skipped and stats.count > 0 and sum(stats.total) == stats.count
    assert len(trainer.prepare(micro[0]).segments) == 4
    metric_copies = [s for s in copies if s in ((2 + 2 * 4,), (4,))]  # the step's sums, or one depth count
    assert metric_copies == [(2 + 2 * 4,)], copies


def test_depth_counts_equal_the_bincount_of_the_counted_elements() -> None:
    g = torch.Generator().manual_seed(0)
    depth = torch.randint(0, 6, (200,), generator=g)
    valid, correct = torch.rand(200, generator=g) > 0.3, torch.rand(200, generator=g) > 0.5
    out = loss._summarise(torch.tensor(1.0), correct, valid, ~valid, depth, 4)
    d = depth.clamp(0, 3)
    assert torch.equal(out.total, torch.bincount(d[valid], minlength=4)[:4])
    assert torch.equal(out.correct, torch.bincount(d[valid & correct], minlength=4)[:4])
    assert out.total.dtype == out.correct.dtype == torch.int64
