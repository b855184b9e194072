"""On CUDA the trainer's attention is the compiled flex-attention BlockMask; the dense bool mask through SDPA is
the path the CPU tests check against the reference step. Same batch, same weights: equal loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.bench_dtype import train_step
from bench.bench_gpu import cuda_setup
from peagle_pipeline.core import mask as mask_mod
from peagle_pipeline.core.loss import Counted, kl_topk
from peagle_pipeline.core.model import Owned, layout_inputs
from peagle_pipeline.core.partition import plan_segments


def dense_step(setup: tuple, depths: int) -> float:
    """The same step with dense bool masks (SDPA) on the CUDA tensors, one segment, fp32."""
    model, vocab, lay, toks, aux, weight, ids, lp, _ = setup
    model.zero_grad(set_to_none=True)
    ew = lay.element_weight(weight)
    count = int(ew.sum())
    (seg,) = plan_segments(lay, 1, ew)
    sub = lay.select(seg.index)
    out_index = seg.out_index.to(toks.device)
    hidden = model(
        **layout_inputs(sub, toks, aux.float()),
        attn_mask=mask_mod.dense_mask(sub),
        owned=Owned(out_index, mask_mod.dense_mask(sub, out_index)),
    )
    owned = seg.owned_elements.to(toks.device)
    t = lay.target[owned]
    out = kl_topk(
        hidden, model.lm_head.weight, ids[t], lp[t], Counted(ew[owned], lay.depth[owned], depths), vocab, 1024
    )
    (out.loss_sum / count).backward()
    return float(out.loss_sum.detach()) / count


@pytest.mark.parametrize("segments", [1, 4])
def test_compiled_block_mask_equals_dense_sdpa(segments):
    depths = 4
    setup = cuda_setup(1536, 3, depths, layers=2)  # 2 layers: the full mask and the owned-query mask both run
    assert not isinstance(mask_mod.build_mask(setup[2], "cuda"), torch.Tensor)  # a flex BlockMask on CUDA
    dense_model = copy.deepcopy(setup[0])
    dense = (dense_model, *setup[1:])
    loss_dense = dense_step(dense, depths)
    loss_flex = train_step(setup, "fp32", depths, segments)
    assert loss_flex == pytest.approx(loss_dense, rel=1e-5)
    for (name, p_flex), p_dense in zip(setup[0].named_parameters(), dense_model.parameters(), strict=True):
        if p_flex.grad is None:
            assert p_dense.grad is None, name
            continue
        rel = float((p_flex.grad - p_dense.grad).norm() / p_dense.grad.norm().clamp_min(1e-12))
        assert rel < 1e-4, f"{name}: gradient differs by {rel:.1e} (segments={segments})"


def test_eagle3_steps_with_block_masks_equal_dense_masks():
    """EAGLE-3's K steps on CUDA (one flex BlockMask per step, from the same predicate) give the outputs and
    gradients of the dense masks."""
    from bench.reference_step import tiny_batch, tiny_draft
    from peagle_pipeline.core.cod import CODConfig, build_layout
    from peagle_pipeline.core.eagle3 import Eagle3Draft, step_masks, ttt_inputs

    peagle, vocab, pieces = tiny_draft(seed=3, layers=2)
    model = Eagle3Draft(peagle.cfg, pieces, vocab, generator=torch.Generator().manual_seed(3)).cuda()
    docs = [300, 200]
    tokens, aux, weight, _, _ = tiny_batch(1, docs, 520, 512, 3 * 64, p_valid=0.9)
    lay = build_layout(docs, weight, CODConfig(depths=4), None, full=True)
    inputs = ttt_inputs(lay.to("cuda"), tokens.cuda(), aux.cuda())
    assert not isinstance(inputs["masks"][1], torch.Tensor)  # flex BlockMasks on CUDA
    dense = {**inputs, "masks": [m.cuda() for m in step_masks(lay, "cpu")]}
    valid = lay.doc.cuda() >= 0  # padding rows attend nowhere: left out
    outs, grads = [], []
    for given in (inputs, dense):
        model.zero_grad(set_to_none=True)
        hidden = model(**given)
        (hidden[valid].float().pow(2).mean()).backward()
        outs.append(hidden.detach())
        grads.append(model.fc.weight.grad.detach().clone())
    assert torch.allclose(outs[0][valid], outs[1][valid], atol=1e-4)
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-4
