"""Loader planning (pure, from the sample table): held-out split, packing, per-epoch shuffle, rank sharding, shift."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from peagle_pipeline.cache.reader import SampleArrays
from peagle_pipeline.core.heldout import split_samples
from peagle_pipeline.errors import BadConfig, CorruptCache
from peagle_pipeline.stages.train.held_out_eval import eval_plans
from peagle_pipeline.stages.train.loader import Cursor, LoaderSettings, TrainLoader, ahead_to_device
from peagle_pipeline.stages.train.packed_batch import into_shared_memory, read_packed, shift_sample
from peagle_pipeline.stages.train.packing import RowPlan, pack_epoch, pack_rows, truncation


def _settings(budget: int) -> LoaderSettings:
    """Loader settings of a single-process, in-process (no workers) run with seed 0."""
    return LoaderSettings(budget=budget, seed=0, num_workers=0, need_last_hidden=False, skip_corrupt=False)


def table(lengths, supervised=None) -> pd.DataFrame:
    n = len(lengths)
    return pd.DataFrame(
        {
            "sample_id": np.arange(n),
            "length": lengths,
            "num_supervised": supervised if supervised is not None else [3] * n,
        }
    )


def test_pack_rows_greedy_with_truncation() -> None:
    rows = pack_rows(np.array([7, 8, 9, 10]), np.array([4, 5, 3, 12]), budget=10)
    assert [(r.sample_ids, r.lengths) for r in rows] == [((7, 8), (4, 5)), ((9,), (3,)), ((10,), (10,))]
    assert all(r.tokens <= 10 for r in rows)


def test_pack_rows_cuts_at_longest_not_at_the_row_budget() -> None:
    rows = pack_rows(np.array([7, 8, 9, 10]), np.array([4, 5, 3, 12]), budget=10, longest=16)
    assert [(r.sample_ids, r.lengths) for r in rows] == [((7, 8), (4, 5)), ((9,), (3,)), ((10,), (12,))]
    assert pack_rows(np.array([1, 2]), np.array([20, 2]), budget=10, longest=16)[0].lengths == (16,)


def test_held_out_rows_keep_what_training_keeps() -> None:
    """At K = 8 the evaluation packs rows of tokens_per_step / 4 tokens, but a longer held-out sample is evaluated
    up to tokens_per_step, as training reads it, not cut at the row size (which dropped its reply's end)."""
    split = SimpleNamespace(eval_ids=np.array([1, 2, 3]), eval_lengths=np.array([40, 100, 300]))
    cfg = SimpleNamespace(depths=8, tokens_per_step=256, sequence_partitions=1)
    trainer = SimpleNamespace(cfg=cfg, eval_set=split)
    assert [r.lengths for r in eval_plans(trainer)] == [(40,), (100,), (256,)]
    cfg.sequence_partitions = 4  # a run that partitions to fit memory: rows stay at the row size
    assert [r.lengths for r in eval_plans(trainer)] == [(40,), (64,), (64,)]
    cfg.depths, cfg.sequence_partitions = 2, 1  # rows of tokens_per_step: the samples that fit share one
    assert [r.lengths for r in eval_plans(trainer)] == [(40, 100), (256,)]


def test_truncation_counts_what_the_budget_cuts() -> None:
    """tokens_per_step below a sample's length cuts it (pack_rows above); the trainer reports or refuses this."""
    split = split_samples(table([5, 13, 16, 2]), 0, seed=0)  # shifted lengths 4, 12, 15, 1
    assert truncation(split, 10) == (2, 7, 32, 15)
    assert truncation(split, 15) == (0, 0, 32, 15)


def test_split_skips_unsupervised_and_is_fixed_by_seed() -> None:
    t = table(
        [5] * 20 + [1, 9], supervised=[2] * 20 + [1, 0]
    )  # id 20: one token (S=0); id 21: nothing supervised
    a, b, c = split_samples(t, 4, seed=0), split_samples(t, 4, seed=0), split_samples(t, 4, seed=1)
    assert a.skipped_unsupervised == 2 and len(a.eval_ids) == 4 and len(a.train_ids) == 16
    assert np.array_equal(a.eval_ids, b.eval_ids) and not np.array_equal(a.eval_ids, c.eval_ids)
    assert not set(a.eval_ids) & set(a.train_ids) and not {20, 21} & (set(a.train_ids) | set(a.eval_ids))
    assert np.array_equal(a.train_lengths, np.full(16, 4))  # shifted rows S = T - 1
    assert len(split_samples(table([5] * 3), 10, 0).eval_ids) == 1  # never more than half held out


def test_epoch_shuffle_depends_on_seed_and_epoch_only() -> None:
    split = split_samples(table(list(range(3, 43))), 0, seed=5)
    e0, again, e1 = pack_epoch(split, 50, 5, 0), pack_epoch(split, 50, 5, 0), pack_epoch(split, 50, 5, 1)
    assert e0 == again and e0 != e1
    assert sorted(s for r in e0 for s in r.sample_ids) == sorted(split.train_ids.tolist())


def test_two_ranks_see_what_one_rank_with_two_micro_steps_sees() -> None:
    split = split_samples(table([20] * 30), 0, seed=0)
    one = TrainLoader(None, split, _settings(40), rank=0, world_size=1, micro_steps=2)
    r0 = TrainLoader(None, split, _settings(40), rank=0, world_size=2, micro_steps=1)
    r1 = TrainLoader(None, split, _settings(40), rank=1, world_size=2, micro_steps=1)
    assert one.steps_in_epoch(0) == r0.steps_in_epoch(0) == 7  # 15 rows // 2
    for s in range(7):
        assert one.rows_of_step(s) == r0.rows_of_step(s) + r1.rows_of_step(s)


def test_too_little_data_is_a_config_error() -> None:
    split = split_samples(table([20] * 3), 0, seed=0)
    with pytest.raises(BadConfig, match="fewer than the 4"):
        TrainLoader(None, split, _settings(100), world_size=4)


def _sample(T: int, seed: int = 0) -> SampleArrays:
    g = torch.Generator().manual_seed(seed)
    return SampleArrays(
        input_ids=torch.arange(T) + 100 * seed,
        loss_mask=torch.arange(T) % 2 == 1,
        aux_hidden=torch.randn(T, 2, 4, generator=g),
        topk_ids=torch.arange(T)[:, None].repeat(1, 3),
        topk_logprobs=torch.randn(T, 3, generator=g),
        last_hidden=torch.randn(T, 4, generator=g),
    )


def test_shift_pairs_token_next_with_aux_here() -> None:
    s = _sample(6)
    out = shift_sample(s, 4, need_last_hidden=True)  # truncated to 4 of S = 5 shifted rows
    assert out["input_ids"].tolist() == [1, 2, 3, 4]  # x_{i+1}
    assert torch.equal(out["aux_hidden"], s.aux_hidden[:4].reshape(4, 8))  # g_i
    assert out["topk_ids"][:, 0].tolist() == [1, 2, 3, 4]  # P_{i+1}
    assert out["weight"].tolist() == [True, False, True, False]  # m_{i+1}
    assert torch.equal(out["last_hidden"], s.last_hidden[1:5])


class _Cache:
    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def read_sample(self, sid: int) -> SampleArrays:
        if sid in self.bad:
            raise CorruptCache(f"sample {sid} is damaged")
        return _sample(8, sid)


def test_read_packed_concatenates_and_reports_corrupt() -> None:
    plan = RowPlan((1, 2, 3), (7, 3, 5))
    b = read_packed(_Cache(set()), plan, 0, 0, False, False)
    assert b.doc_lengths == [7, 3, 5] and b.num_tokens == 15 and b.aux_hidden.shape == (15, 8)
    assert b.input_ids[7:10].tolist() == [201, 202, 203]
    skipped = read_packed(_Cache({2}), plan, 0, 0, False, True)
    assert skipped.sample_ids == [1, 3] and skipped.corrupt[0][0] == 2 and skipped.num_tokens == 12
    stopped = read_packed(_Cache({2}), plan, 0, 0, False, False)
    assert stopped.corrupt and stopped.sample_ids == [1]


def test_a_worker_row_goes_into_shared_memory_before_it_is_sent() -> None:
    # The row is moved by the worker itself, where a full /dev/shm can be reported (tests/integration/
    # test_write_faults.py runs that case on a real small /dev/shm).
    b = read_packed(_Cache(set()), RowPlan((1, 2), (7, 3)), 0, 0, False, False)
    assert not b.aux_hidden.is_shared()
    shared = into_shared_memory(b)
    assert shared is b and shared.no_shared_memory is None
    assert all(t.is_shared() for t in (b.input_ids, b.aux_hidden, b.topk_ids, b.topk_logprobs, b.weight))
    assert b.input_ids[7:10].tolist() == [201, 202, 203]


def test_iterate_resumes_from_cursor() -> None:
    split = split_samples(table([9] * 12), 0, seed=0)
    full = TrainLoader(_Cache(set()), split, _settings(16))
    n = full.steps_in_epoch(0)
    stream = full.iterate(Cursor())
    seen = [(c, [b.sample_ids for b in micro]) for c, micro in (next(stream) for _ in range(n + 2))]
    assert seen[n - 1][0] == Cursor(1, 0) and seen[n][0] == Cursor(1, 1)
    resumed = full.iterate(seen[2][0])
    assert [b.sample_ids for b in next(resumed)[1]] == seen[3][1]


def test_all_positions_weighs_every_shifted_row() -> None:
    s = _sample(6)
    out = shift_sample(s, 5, need_last_hidden=False, all_positions=True)
    assert out["weight"].tolist() == [True] * 5
    assert out["input_ids"].tolist() == shift_sample(s, 5, need_last_hidden=False)["input_ids"].tolist()
    plan = RowPlan((1, 2), (7, 3))
    masked = read_packed(_Cache(set()), plan, 0, 0, False, False)
    everywhere = read_packed(_Cache(set()), plan, 0, 0, False, False, all_positions=True)
    assert masked.weight.sum() == 6 and everywhere.weight.all() and everywhere.weight.numel() == 10


def test_ahead_to_device_passes_cpu_rows_through_and_closes_the_loader() -> None:
    """The CUDA prefetch wrapper leaves a CPU run's stream as it is (same steps, same tensors) and
    closing it closes the loader's stream (which ends its workers)."""
    split = split_samples(table([9] * 12), 0, seed=0)
    loader = TrainLoader(_Cache(set()), split, _settings(16))
    inner = loader.iterate(Cursor())
    wrapped = ahead_to_device(inner, torch.device("cpu"))
    got = [next(wrapped) for _ in range(3)]
    want = [next(loader.iterate(Cursor())) for _ in range(1)]
    assert got[0][0] == want[0][0] and [b.sample_ids for b in got[0][1]] == [b.sample_ids for b in want[0][1]]
    assert torch.equal(got[0][1][0].aux_hidden, want[0][1][0].aux_hidden)
    wrapped.close()
    with pytest.raises(StopIteration):
        next(inner)


def test_a_row_moves_to_a_device_but_keeps_its_weight_on_the_host() -> None:
    """`to_device` moves the states (the COD layout reads `weight` on the host, so it stays there)."""
    b = read_packed(_Cache(set()), RowPlan((1, 2), (7, 3)), 0, 0, False, False)
    moved = b.to_device(torch.device("meta"))
    assert moved.aux_hidden.device.type == "meta" and moved.topk_ids.device.type == "meta"
    assert moved.weight is b.weight and moved.sample_ids == b.sample_ids
