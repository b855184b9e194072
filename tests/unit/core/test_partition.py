"""Sequence partitioning: segment membership rules and exact equality with a single pass."""

from __future__ import annotations

import pytest
import torch

from bench.reference_step import tiny_batch, tiny_draft
from peagle_pipeline.core.cod import CODConfig, build_layout
from peagle_pipeline.core.loss import Counted, kl_topk
from peagle_pipeline.core.partition import forward_segment, plan_segments, segment_ids


def _setup(seed, layers=1):
    model, vocab, _ = tiny_draft(seed=seed, layers=layers)
    docs, L = [30, 22, 9], 64
    tokens, aux, weight, ids, lp = tiny_batch(seed, docs, L, 512, 192)
    lay = build_layout(docs, weight, CODConfig(depths=4), torch.Generator().manual_seed(seed))
    return model, vocab, lay, tokens, aux, weight, ids, lp


def _run(model, vocab, lay, tokens, aux, weight, ids, lp, n):
    model.zero_grad()
    ew = lay.element_weight(weight)
    total = torch.zeros(())
    for seg in plan_segments(lay, n, ew):
        hidden, owned = forward_segment(model, lay, seg, tokens, aux)
        t = lay.target[owned]
        out = kl_topk(
            hidden,
            model.lm_head.weight,
            ids[t],
            lp[t],
            Counted(ew[owned], lay.depth[owned], 4),
            vocab,
            chunk=16,
        )
        out.loss_sum.backward()
        total += out.loss_sum.detach()
    return total, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("seed,layers", [(0, 1), (1, 2), (2, 1)])
def test_segments_sum_to_single_pass(seed, layers):
    model, *rest = _setup(seed, layers)
    base_loss, base_grads = _run(model, *rest, n=1)
    for n in range(2, 9):
        loss, grads = _run(model, *rest, n=n)
        assert torch.allclose(loss, base_loss, rtol=1e-5), n
        for k, g in base_grads.items():
            assert torch.allclose(grads[k], g, rtol=1e-5, atol=1e-6 * float(g.abs().max())), (n, k)


def test_membership_rules():
    _, _, lay, _, _, weight, _, _ = _setup(0)
    seg = segment_ids(lay, 4)
    L = lay.rows
    rows_seg = seg[:L]
    assert bool((rows_seg.diff() >= 0).all()) and rows_seg.unique().tolist() == [0, 1, 2, 3]
    deep = lay.depth >= 1
    assert torch.equal(seg[deep], rows_seg[lay.anchor[deep] + 1])  # chain's depth-1 row decides
    plans = plan_segments(lay, 4)
    owned = torch.cat([p.owned_elements for p in plans]).sort().values
    assert torch.equal(owned, torch.arange(len(lay)))  # every element owned exactly once
    for j, p in enumerate(plans):
        context = p.index[~p.owned]
        assert bool((lay.depth[context] == 0).all())
        right = int(torch.nonzero(rows_seg == j).max()) + 1
        assert torch.equal(p.index[p.index < L], torch.arange(right))
