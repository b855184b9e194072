"""The numerical guard of one train step on a real tiny cache: non-finite steps change nothing, are counted,
and stop the run with NumericalFault after max_bad_steps in a row; a good step resets the count.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from peagle_pipeline.config import TrainConfig, resolve
from peagle_pipeline.errors import NumericalFault
from peagle_pipeline.stages.train.distributed import Dist
from peagle_pipeline.stages.train.loader import Cursor
from peagle_pipeline.stages.train.trainer import Trainer

pytestmark = pytest.mark.slow


def _poison(micro):
    return [dataclasses.replace(b, aux_hidden=torch.full_like(b.aux_hidden, float("nan"))) for b in micro]


def test_nan_steps_are_skipped_then_stop(tiny_cache: Path, tmp_path: Path) -> None:
    cfg = resolve(
        TrainConfig,
        None,
        {
            "cache": str(tiny_cache),
            "output": str(tmp_path / "run"),
            "depths": 4,
            "tokens_per_step": 200,
            "precision": "fp32",
            "max_bad_steps": 2,
            "eval_samples": 0,
            "num_workers": 0,
            "warmup": 0,
        },
    )
    trainer = Trainer(cfg, Dist())
    stream = trainer.loader.iterate(Cursor())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    stats = trainer.train_step(_poison(next(stream)[1]))
    assert stats.skipped and trainer.bad_steps == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert not trainer.optimizer.state  # AdamW never stepped

    good = trainer.train_step(next(stream)[1])
    assert not good.skipped and trainer.bad_steps == 0 and good.count > 0 and good.grad_norm > 0
    assert not torch.equal(before["fc.weight"], trainer.model.fc.weight)

    trainer.train_step(_poison(next(stream)[1]))
    with pytest.raises(NumericalFault, match="2 consecutive"):
        trainer.train_step(_poison(next(stream)[1]))


def _short_run(cache: Path, out: Path, **over: object) -> TrainConfig:
    """fp32 steps of 256 tokens at K = 4, no warm-up, no held-out samples, no loader worker."""
    base = {"depths": 4, "tokens_per_step": 256, "precision": "fp32", "eval_samples": 0, "num_workers": 0}
    return resolve(TrainConfig, None, {**base, "warmup": 0, "cache": str(cache), "output": str(out), **over})


def test_sequence_partitions_give_the_same_update(tiny_cache: Path, tmp_path: Path) -> None:
    """Per-segment backward (2 and 3 segments, no_sync-free single process) equals the single pass (fp32)."""
    weights = []
    for n in (1, 2, 3):
        cfg = _short_run(tiny_cache, tmp_path / f"run{n}", sequence_partitions=n, draft_vocab_size=300)
        trainer = Trainer(cfg, Dist())
        stream = trainer.loader.iterate(Cursor())
        losses = [trainer.train_step(next(stream)[1]).loss_sum for _ in range(2)]
        weights.append((losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    (l1, w1) = weights[0]
    for losses, w in weights[1:]:
        assert losses == pytest.approx(l1, rel=1e-5)
        # atol 1e-5, 1.7 % of one AdamW step (lr 6e-4): Adam divides each gradient by its own size, so summation-
        # order noise on a near-zero gradient moves that weight by up to a step's fraction (1.4e-6 on one of 4,096
        # v_proj weights on an AVX2-only CPU, 2026-11-28); a segment's gradient lost moves thousands by ~lr
        for key in w1:
            torch.testing.assert_close(w[key], w1[key], rtol=1e-5, atol=1e-5, msg=key)


def test_sparse_embedding_gradient_gives_the_dense_update(tiny_cache: Path, tmp_path: Path) -> None:
    """A single CPU process keeps the embedding table's gradient sparse (the rows a step touched); three steps
    give the weights and optimizer moments of the dense gradient that DDP ranks use (fp32)."""
    runs = []
    for sparse in (True, False):
        # clipping on: the norm over a sparse gradient must be the dense one's
        cfg = _short_run(tiny_cache, tmp_path / f"run{sparse}", grad_clip=0.05)
        trainer = Trainer(cfg, Dist())
        assert trainer.model.embed_tokens.sparse
        trainer.model.embed_tokens.sparse = sparse
        stream = trainer.loader.iterate(Cursor())
        stats = [trainer.train_step(next(stream)[1]) for _ in range(3)]
        state = trainer.optimizer.state[trainer.model.embed_tokens.weight]
        runs.append((stats, trainer.model.state_dict(), state))
    (s1, w1, m1), (s2, w2, m2) = runs
    assert [s.grad_norm for s in s1] == pytest.approx([s.grad_norm for s in s2], rel=1e-5)
    assert all(s.grad_norm > 0.05 for s in s1)  # every step was clipped
    for key in w1:
        torch.testing.assert_close(w1[key], w2[key], rtol=1e-5, atol=1e-6, msg=key)
    moved = (m1["exp_avg"] != 0).any(dim=1)
    assert 0 < int(moved.sum()) < len(moved)  # some rows trained, others untouched
    torch.testing.assert_close(m1["exp_avg_sq"], m2["exp_avg_sq"], rtol=1e-5, atol=1e-12)
