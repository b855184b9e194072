"""The attention mask: a hand-checked matrix, flex (eager, CPU) == SDPA dense, no NaN with padding, and the
blocked dense path == attention over every pair."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.core import mask as mask_module
from peagle_pipeline.core.cod import CODConfig, CODLayout, build_layout
from peagle_pipeline.core.mask import attend, build_mask, dense_mask, mask_mod


def _hand_layout() -> CODLayout:
    # packed row: sample 0 = rows 0..2, sample 1 = rows 3..4, padding row 5
    # depth 1: sample 0 positions 1, 2 (anchors 0, 1); sample 1 position 1 (row 4, anchor 3); depth 2: row 2 (anchor 0)
    t = lambda *v: torch.tensor(v)  # noqa: E731
    return CODLayout(
        anchor=t(0, 1, 2, 3, 4, 5, 0, 1, 3, 0),
        depth=t(0, 0, 0, 0, 0, 0, 1, 1, 1, 2),
        doc=t(0, 0, 0, 1, 1, -1, 0, 0, 1, 0),
        position=t(0, 1, 2, 0, 1, 0, 1, 2, 1, 2),
        target=t(0, 1, 2, 3, 4, 5, 1, 2, 4, 2),
    )


EXPECTED = [
    # keys: 0  1  2  3  4  5  6  7  8  9
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # q0 (a0, d0)
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # q1
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # q2
    [0, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # q3 (sample 1 starts: nothing of sample 0)
    [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],  # q4
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # q5 padding: nothing
    [1, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # q6 (a0, d1): context row 0 + itself
    [1, 1, 0, 0, 0, 0, 0, 1, 0, 0],  # q7 (a1, d1)
    [0, 0, 0, 1, 0, 0, 0, 0, 1, 0],  # q8 (a3, d1)
    [1, 0, 0, 0, 0, 0, 1, 0, 0, 1],  # q9 (a0, d2): row 0, its depth-1 element, itself
]


def test_dense_mask_matches_hand_written_matrix():
    lay = _hand_layout()
    assert dense_mask(lay).int().tolist() == EXPECTED
    q = torch.tensor([9, 5, 2])
    assert dense_mask(lay, query=q).int().tolist() == [EXPECTED[i] for i in (9, 5, 2)]
    assert torch.equal(build_mask(lay, "cpu"), dense_mask(lay))


def test_mask_mod_is_the_same_predicate():
    lay = _hand_layout()
    qi, ki = torch.meshgrid(torch.arange(10), torch.arange(10), indexing="ij")
    assert mask_mod(lay)(0, 0, qi, ki).int().tolist() == EXPECTED


def _qkv(n: int, seed: int, hq: int = 4, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, n, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


def test_flex_eager_cpu_forward_equals_sdpa_dense():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    weight = torch.rand(40, generator=torch.Generator().manual_seed(0)) < 0.8
    weight[36:] = False
    lay = build_layout([20, 16], weight, CODConfig(depths=4), torch.Generator().manual_seed(1))
    q, k, v = (t.detach() for t in _qkv(len(lay), 2))
    block = create_block_mask(mask_mod(lay), None, None, len(lay), len(lay), device="cpu")
    with torch.no_grad():
        flex = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
        sdpa = attend(q, k, v, dense_mask(lay))
    live = dense_mask(lay).any(-1)
    assert torch.allclose(flex[:, :, live], sdpa[:, :, live], atol=1e-5)
    assert bool((sdpa[:, :, ~live] == 0).all())


def test_no_nan_with_padding_forward_and_backward():
    weight = torch.ones(12, dtype=torch.bool)
    weight[8:] = False
    lay = build_layout([8], weight, CODConfig(depths=3), torch.Generator().manual_seed(0))
    m = dense_mask(lay)
    assert not bool(m[8:12].any())  # padding rows attend nowhere
    q, k, v = _qkv(len(lay), 3)
    out = attend(q, k, v, m)
    out.square().sum().backward()
    assert bool(torch.isfinite(out).all())
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    assert bool((out[:, :, 8:12] == 0).all()) and bool((q.grad[:, :, 8:12] == 0).all())


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Attention spelled out over every (query, key) pair: softmax of the masked scores, 0 for rows with no key."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = scores.masked_fill(~m, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return weights @ v


@pytest.mark.parametrize("keep_factor", [1_000_000, 0], ids=["kept", "gathered-again"])
def test_blocked_attention_equals_attention_over_every_pair(monkeypatch, keep_factor):
    # 3 samples and padding in one packed row: more elements than one query block, so `attend` splits the queries
    # and gives each block only the keys it may see; a block of padding rows sees none at all. With a keep factor of 0
    # the gathered keys are not kept for backward: backward gathers them again (as for long samples).
    monkeypatch.setattr(mask_module, "GATHER_KEEP_FACTOR", keep_factor)
    torch.manual_seed(0)
    weight = torch.rand(200) < 0.9
    weight[190:] = False
    lay = build_layout([70, 60, 60], weight, CODConfig(depths=4), torch.Generator().manual_seed(3))
    m = dense_mask(lay)
    assert len(lay) > 2 * mask_module.QUERY_BLOCK
    m[-mask_module.QUERY_BLOCK :] = False  # a whole block with no key (as a partition's rows can be)
    q, k, v = _qkv(len(lay), 4)
    out = attend(q, k, v, m)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = _reference(q, k, v, m)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-4)
    assert bool((out[:, :, -mask_module.QUERY_BLOCK :] == 0).all())
