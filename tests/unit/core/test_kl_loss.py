"""Chunked KL: equals the dense computation, gradient q - p, renormalisation, exact mode, metrics."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.core.cod import CODConfig, build_layout
from peagle_pipeline.core.loss import (
    Counted,
    acceptance_estimate,
    acceptance_walk,
    kl_exact,
    kl_topk,
    leading_correct,
)
from peagle_pipeline.core.vocab import build_draft_vocab


def _case(seed=0, N=37, H=16, V=50, Vd=30, k=6):
    g = torch.Generator().manual_seed(seed)
    vocab = build_draft_vocab(torch.randint(0, 100, (V,), generator=g), Vd)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    W = torch.randn(Vd, H, generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    lp = torch.log_softmax(torch.randn(N, k, generator=g), -1)
    weight = torch.rand(N, generator=g) < 0.8
    depth = torch.randint(0, 4, (N,), generator=g)
    return vocab, hidden, W, ids, lp, weight, depth


def _dense_topk(hidden, W, ids, lp, weight, vocab):
    logq = torch.log_softmax(hidden @ W.T, -1)
    d = vocab.target_to_draft[ids]
    p = lp.exp() * (d >= 0)
    dense = torch.zeros_like(logq).scatter_add_(1, d.clamp_min(0), p)
    z = dense.sum(-1, keepdim=True)
    w = weight & (z[:, 0] > 0)
    dense = dense / z.clamp_min(1e-30)
    return ((torch.xlogy(dense, dense) - dense * logq).sum(-1) * w).sum(), int(w.sum()), dense, w


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
def test_chunked_topk_equals_dense_loss_and_gradient(chunk):
    vocab, hidden, W, ids, lp, weight, depth = _case()
    out = kl_topk(hidden, W, ids, lp, Counted(weight, depth, 4), vocab, chunk=chunk)
    out.loss_sum.backward()
    g1 = hidden.grad.clone()
    hidden.grad = None
    ref, count, _, _ = _dense_topk(hidden, W, ids, lp, weight, vocab)
    ref.backward()
    assert torch.allclose(out.loss_sum, ref, rtol=1e-5) and int(out.count) == count
    assert torch.allclose(g1, hidden.grad, rtol=1e-4, atol=1e-6)


def test_float_weights_scale_each_elements_kl_and_gradient():
    """EAGLE-3's per-step weights: a float weight multiplies the element's KL and gradient; the elements with a
    non-zero weight are counted as with a boolean one."""
    vocab, hidden, W, ids, lp, weight, depth = _case()
    factor = 0.5 ** depth.float()
    out = kl_topk(hidden, W, ids, lp, Counted(weight.float() * factor, depth, 4), vocab, chunk=7)
    out.loss_sum.backward()
    g1 = hidden.grad.clone()
    hidden.grad = None
    logq = torch.log_softmax(hidden @ W.T, -1)
    _, count, dense, w = _dense_topk(hidden.detach(), W, ids, lp, weight, vocab)
    ref = ((torch.xlogy(dense, dense) - dense * logq).sum(-1) * w * factor).sum()
    ref.backward()
    assert torch.allclose(out.loss_sum, ref, rtol=1e-5) and int(out.count) == count
    assert torch.allclose(g1, hidden.grad, rtol=1e-4, atol=1e-6)
    plain = kl_topk(hidden.detach(), W, ids, lp, Counted(weight, depth, 4), vocab)
    assert torch.equal(out.correct, plain.correct) and torch.equal(out.total, plain.total)


def test_gradient_wrt_logits_is_q_minus_p():
    vocab, _, _, ids, lp, weight, depth = _case(Vd=30, H=30)
    logits = torch.randn(37, 30, generator=torch.Generator().manual_seed(3), requires_grad=True)
    out = kl_topk(
        logits, torch.eye(30), ids, lp, Counted(weight, depth, 4), vocab, chunk=8
    )  # W = I: hidden = logits
    out.loss_sum.backward()
    _, _, p, w = _dense_topk(logits.detach(), torch.eye(30), ids, lp, weight, vocab)
    q = torch.softmax(logits.detach(), -1)
    assert torch.allclose(logits.grad, (q - p) * w[:, None], atol=1e-6)


def test_renormalises_kept_ids_and_excludes_rows_without_any():
    vocab = build_draft_vocab(torch.tensor([9, 8, 7, 0, 0, 0]), 3)  # draft = target ids 0, 1, 2
    ids = torch.tensor([[0, 4, 1], [4, 5, 3]])
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]))
    hidden = torch.zeros(2, 3, requires_grad=True)  # uniform draft q = 1/3
    out = kl_topk(
        hidden, torch.eye(3), ids, lp, Counted(torch.tensor([True, True]), torch.tensor([0, 1]), 2), vocab
    )
    p = torch.tensor([0.5, 0.1]) / 0.6  # ids 0 and 1 kept, renormalised
    expected = float((p * (p.log() - torch.log(torch.tensor(1 / 3)))).sum())
    assert abs(float(out.loss_sum) - expected) < 1e-5
    assert int(out.count) == 1 and int(out.excluded) == 1
    assert out.total.tolist() == [1, 0]


def test_exact_mode_equals_full_softmax_kl():
    g = torch.Generator().manual_seed(5)
    N, H, Vd = 23, 16, 40
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    W = torch.randn(Vd, H, generator=g)
    h_last = torch.randn(N, H, generator=g) * 3
    nw = 1 + 0.1 * torch.randn(H, generator=g)
    weight = torch.rand(N, generator=g) < 0.7
    depth = torch.zeros(N, dtype=torch.long)
    out = kl_exact(hidden, W, h_last, (nw, 1e-5), Counted(weight, depth, 1), chunk=4)
    out.loss_sum.backward()
    normed = h_last * torch.rsqrt(h_last.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
    logp = torch.log_softmax(normed @ W.T, -1)
    h2 = hidden.detach().requires_grad_()
    logq = torch.log_softmax(h2 @ W.T, -1)
    ref = ((logp.exp() * (logp - logq)).sum(-1) * weight).sum()
    ref.backward()
    assert torch.allclose(out.loss_sum, ref, rtol=1e-5)
    assert torch.allclose(hidden.grad, h2.grad, rtol=1e-4, atol=1e-6)
    agree = (logq.argmax(-1) == logp.argmax(-1)) & weight
    assert int(out.correct[0]) == int(agree.sum()) and int(out.total[0]) == int(weight.sum())


def test_per_depth_agreement_counts():
    vocab, hidden, W, ids, lp, weight, depth = _case(seed=2)
    out = kl_topk(hidden, W, ids, lp, Counted(weight, depth, 4), vocab)
    _, _, _, w = _dense_topk(hidden.detach(), W, ids, lp, weight, vocab)
    top1 = ids.gather(1, lp.argmax(-1, keepdim=True))[:, 0]
    right = (vocab.ids[(hidden @ W.T).argmax(-1)] == top1) & w
    for d in range(4):
        assert int(out.total[d]) == int((w & (depth == d)).sum())
        assert int(out.correct[d]) == int((right & (depth == d)).sum())


def test_acceptance_estimate_on_full_layout():
    weight = torch.tensor([0, 1, 1, 1, 1, 0], dtype=torch.bool)
    lay = build_layout([6], weight, CODConfig(depths=3), None, full=True)
    ew = lay.element_weight(weight)
    correct = torch.ones(len(lay), dtype=torch.bool)
    s, n = acceptance_estimate(lay, correct, ew, 3)
    # anchors 1..4 weighted; 1 + leading correct depths: a1 rows 1,2,3 -> 4; a2 rows 2,3,4 -> 4;
    # a3 rows 3,4 (row 5 unweighted, chain ends) -> 3; a4 row 4 -> 2
    assert int(n) == 4 and float(s) == 4 + 4 + 3 + 2
    wrong_depth1 = correct & ~((lay.depth == 1) & (lay.anchor == 1))
    s2, _ = acceptance_estimate(lay, wrong_depth1, ew, 3)
    assert float(s2) == float(s) - 2  # anchor 1 now stops after depth 0


def _correct_for(lay, leading: dict[int, int]) -> torch.Tensor:
    """element_correct where anchor a's first `leading[a]` depths are right and the next one wrong."""
    return torch.tensor(
        [d < leading.get(int(a), 0) for a, d in zip(lay.anchor, lay.depth, strict=True)], dtype=torch.bool
    )


def test_acceptance_walk_worked_example():
    weight = torch.tensor([0, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    lay = build_layout([7], weight, CODConfig(depths=3), None, full=True)
    ew = lay.element_weight(weight)
    correct = _correct_for(lay, {1: 2, 2: 0, 3: 3, 4: 2, 5: 0})
    assert leading_correct(lay, correct, ew, 3).tolist() == [0, 2, 0, 3, 2, 0, 0]
    assert acceptance_walk(lay, correct, ew, 3) == (
        3,
        2,
    )  # rows 1 (+2) and 4 (+1: row 5's target is past the reply)
    s, n = acceptance_estimate(lay, correct, ew, 3)
    assert (float(s), int(n)) == (5 + 7, 5)  # the anchor mean counts every row, row 5 included


def test_acceptance_walk_equals_stepping_through_each_reply():
    """Against a plain re-implementation: per sample and reply, step from the reply's first row by accepted + 1."""
    g = torch.Generator().manual_seed(0)
    K = 4
    for trial in range(30):
        lengths = torch.randint(3, 30, (3,), generator=g).tolist()
        weight = torch.rand(sum(lengths), generator=g) < 0.8
        lay = build_layout(lengths, weight, CODConfig(depths=K), None, full=True)
        ew = lay.element_weight(weight)
        correct = torch.rand(len(lay), generator=g) < 0.7
        # reference: a {(anchor, depth): right} table, walked reply by reply
        right = {
            (int(a), int(d)): bool(c and w)
            for a, d, c, w in zip(lay.anchor, lay.depth, correct, ew, strict=True)
        }
        accepted = steps = start = 0
        for n_rows in lengths:
            rows = list(range(start, start + n_rows))
            replies, cur = [], []
            for r in rows:
                if weight[r]:
                    cur.append(r)
                elif cur:
                    replies, cur = replies + [cur], []
            replies += [cur] if cur else []
            for reply in replies:
                last = reply[-1]
                a = reply[0]
                while a < last:  # the proposal made at the reply's last row is never verified
                    n = 0
                    while n < K and a + n < last and right.get((a, n), False):
                        n += 1
                    accepted, steps, a = accepted + n, steps + 1, a + n + 1
            start += n_rows
        assert acceptance_walk(lay, correct, ew, K) == (accepted, steps), trial
