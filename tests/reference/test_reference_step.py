"""The optimised step (core: vectorised mask, aux_index/out_index forward, chunked KL, partitioning) equals
the direct reference step in loss and gradients."""

from __future__ import annotations

import pytest
import torch

from bench.reference_step import reference_mask, reference_step, tiny_batch, tiny_draft
from peagle_pipeline.core.cod import CODConfig, build_layout
from peagle_pipeline.core.loss import Counted, kl_topk
from peagle_pipeline.core.mask import dense_mask
from peagle_pipeline.core.partition import forward_segment, plan_segments


def optimised_step(model, vocab, lay, tokens, aux, weight, ids, lp, segments=1, chunk=16):
    """The production composition: plan -> forward per segment -> chunked KL -> backward per segment."""
    ew = lay.element_weight(weight)
    count = int(ew.sum())  # the caller's global divisor (exclusions counted below)
    outs = []
    for seg in plan_segments(lay, segments, ew):
        hidden, owned = forward_segment(model, lay, seg, tokens, aux)
        t = lay.target[owned]
        outs.append(
            kl_topk(
                hidden,
                model.lm_head.weight,
                ids[t],
                lp[t],
                Counted(ew[owned], lay.depth[owned], 4),
                vocab,
                chunk,
            )
        )
        count -= int(outs[-1].excluded)
    loss = torch.zeros(())
    for out in outs:  # divide by the global count, then backward (in a trainer: per segment, same result)
        (out.loss_sum / count).backward()
        loss += out.loss_sum.detach()
    return loss, count


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "seed,layers,nbr,segments", [(0, 1, False, 1), (1, 2, False, 3), (2, 1, True, 2), (3, 2, True, 1)]
)
def test_optimised_equals_reference(seed, layers, nbr, segments):
    model, vocab, _ = tiny_draft(seed=seed, layers=layers, norm_before_residual=nbr)
    docs, L = [25, 18], 48
    tokens, aux, weight, ids, lp = tiny_batch(seed, docs, L, 512, 192)
    weight[0] = True  # exercise the position-0 fix
    lay = build_layout(docs, weight, CODConfig(depths=4), torch.Generator().manual_seed(seed))
    ref_loss, ref_count = reference_step(model, lay, tokens, aux, weight, ids, lp, vocab)
    ref_grads = _grads(model)
    model.zero_grad()
    loss, count = optimised_step(model, vocab, lay, tokens, aux, weight, ids, lp, segments)
    assert count == ref_count
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    grads = _grads(model)
    assert set(grads) == set(ref_grads)
    for k, g in ref_grads.items():
        assert torch.allclose(grads[k], g, rtol=1e-4, atol=1e-5 * float(g.abs().max())), k


def test_reference_mask_equals_core_mask():
    g = torch.Generator().manual_seed(0)
    weight = torch.rand(50, generator=g) < 0.7
    weight[45:] = False
    lay = build_layout([20, 25], weight, CODConfig(depths=5), g)
    assert torch.equal(reference_mask(lay), dense_mask(lay))
