"""Optimizer and schedule: the learning rate is a pure function of the step; embedding tables are updated only in
the rows that have a gradient, and exactly as AdamW there."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.stages.train.optim import (
    RowSparseAdamW,
    build_optimizer,
    clip_grad_norm,
    effective_warmup,
    lr_at,
)


def test_warmup_then_cosine() -> None:
    got = [lr_at(s, 1.0, 2, 6, "cosine") for s in range(6)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447], abs=1e-6)


def test_linear_and_constant() -> None:
    assert [lr_at(s, 2.0, 0, 4, "linear") for s in range(4)] == pytest.approx([2.0, 1.5, 1.0, 0.5])
    assert {lr_at(s, 2.0, 3, 10, "constant") for s in range(3, 10)} == {2.0}
    assert lr_at(50, 1.0, 2, 10, "cosine") == pytest.approx(0.0)  # past the end (steps extended): stays at 0


def _tables(seed: int = 0) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    torch.manual_seed(seed)
    return torch.nn.Embedding(12, 5), torch.nn.Linear(5, 3)


def _step(
    emb: torch.nn.Embedding, lin: torch.nn.Linear, opt: torch.optim.Optimizer, ids: torch.Tensor
) -> None:
    opt.zero_grad(set_to_none=True)
    lin(emb(ids)).pow(2).sum().backward()
    opt.step()


def test_row_sparse_adamw_equals_adamw_where_every_row_has_a_gradient() -> None:
    (e1, l1), (e2, l2) = _tables(), _tables()
    plain = torch.optim.AdamW(
        [*e1.parameters(), *l1.parameters()], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1
    )
    sparse = RowSparseAdamW(
        [*e2.parameters(), *l2.parameters()], [e2.weight], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1
    )
    ids = torch.arange(12)
    for _ in range(5):
        _step(e1, l1, plain, ids)
        _step(e2, l2, sparse, ids)
    torch.testing.assert_close(e2.weight, e1.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(l2.weight, l1.weight, rtol=0, atol=0)


def test_rows_without_a_gradient_keep_weights_and_moments() -> None:
    emb, lin = _tables()
    opt = RowSparseAdamW([*emb.parameters(), *lin.parameters()], [emb.weight], lr=0.05, weight_decay=0.1)
    _step(emb, lin, opt, torch.tensor([0, 1, 2]))
    before = emb.weight.detach().clone()
    m, v = opt.state[emb.weight]["exp_avg"].clone(), opt.state[emb.weight]["exp_avg_sq"].clone()
    _step(emb, lin, opt, torch.tensor([2, 3]))  # rows 0 and 1 have momentum but no gradient now
    after = emb.weight.detach()
    assert torch.equal(after[[0, 1, 4, 5]], before[[0, 1, 4, 5]])  # plain AdamW would move rows 0 and 1
    assert torch.equal(opt.state[emb.weight]["exp_avg"][[0, 1]], m[[0, 1]])
    assert torch.equal(opt.state[emb.weight]["exp_avg_sq"][[0, 1]], v[[0, 1]])
    assert not torch.equal(after[[2, 3]], before[[2, 3]])
    assert float(opt.state[emb.weight]["step"]) == 2.0


def test_the_state_dict_loads_into_plain_adamw_and_back() -> None:
    emb, lin = _tables()
    params = [*emb.parameters(), *lin.parameters()]
    opt = RowSparseAdamW(params, [emb.weight], lr=0.05)
    _step(emb, lin, opt, torch.tensor([1, 4]))
    plain = torch.optim.AdamW(params, lr=0.05)
    plain.load_state_dict(opt.state_dict())
    again = RowSparseAdamW(params, [emb.weight], lr=0.05)
    again.load_state_dict(plain.state_dict())
    torch.testing.assert_close(again.state[emb.weight]["exp_avg"], opt.state[emb.weight]["exp_avg"])


def test_build_optimizer_makes_the_draft_embedding_row_sparse() -> None:
    from bench.reference_step import tiny_draft

    model, _, _ = tiny_draft()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0)
    assert isinstance(opt, RowSparseAdamW)
    assert opt._row_sparse == {id(model.embed_tokens.weight)}
    assert all(p.requires_grad for g in opt.param_groups for p in g["params"])


def test_a_closure_computes_the_gradients_the_step_uses() -> None:
    (e1, l1), (e2, l2) = _tables(), _tables()
    ids = torch.tensor([3, 7])
    plain = RowSparseAdamW([*e1.parameters(), *l1.parameters()], [e1.weight], lr=0.05)
    _step(e1, l1, plain, ids)
    withc = RowSparseAdamW([*e2.parameters(), *l2.parameters()], [e2.weight], lr=0.05)

    def closure() -> float:
        withc.zero_grad(set_to_none=True)
        out = l2(e2(ids)).pow(2).sum()
        out.backward()
        return float(out)

    assert withc.step(closure) is not None
    torch.testing.assert_close(e2.weight, e1.weight, rtol=0, atol=0)
    torch.testing.assert_close(l2.weight, l1.weight, rtol=0, atol=0)


def test_a_sparse_gradient_gives_the_dense_update() -> None:
    # Row 3 is looked up but contributes nothing (times 0): its gradient is all zero, dense or sparse, and it
    # keeps its weights and moments either way.
    runs = []
    for sparse in (True, False):
        torch.manual_seed(0)
        emb, lin = torch.nn.Embedding(12, 5, sparse=sparse), torch.nn.Linear(5, 3)
        opt = RowSparseAdamW([*emb.parameters(), *lin.parameters()], [emb.weight], lr=0.05, weight_decay=0.1)
        for ids in (torch.tensor([0, 1, 1, 3]), torch.tensor([1, 2, 3, 3])):
            opt.zero_grad(set_to_none=True)
            scale = (ids != 3).float()[:, None]
            (lin(emb(ids) * scale).pow(2).sum()).backward()
            assert emb.weight.grad.is_sparse == sparse
            opt.step()
        runs.append((emb.weight.detach().clone(), opt.state[emb.weight]))
    (w_sparse, s_sparse), (w_dense, s_dense) = runs
    torch.testing.assert_close(w_sparse, w_dense, rtol=0, atol=0)
    torch.testing.assert_close(s_sparse["exp_avg_sq"], s_dense["exp_avg_sq"], rtol=0, atol=0)
    assert not bool(s_sparse["exp_avg"][3].any())  # the zero-gradient row was never stepped


def test_clip_grad_norm_equals_torchs_with_a_sparse_gradient() -> None:
    grads = []
    for sparse in (True, False):
        torch.manual_seed(0)
        emb, lin = torch.nn.Embedding(12, 5, sparse=sparse), torch.nn.Linear(5, 3)
        lin(emb(torch.tensor([4, 4, 7, 2]))).pow(2).sum().backward()  # row 4 twice: a sparse grad repeats it
        params = [*emb.parameters(), *lin.parameters()]
        norm = clip_grad_norm(params, 0.5) if sparse else torch.nn.utils.clip_grad_norm_(params, 0.5)
        dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
        after = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in dense])))
        grads.append((float(norm), after, dense))
    (n1, a1, g1), (n2, a2, g2) = grads
    assert n1 == pytest.approx(n2, rel=1e-6) and n1 > 0.5  # the norm before clipping
    assert a1 == pytest.approx(0.5, rel=1e-5) and a2 == pytest.approx(0.5, rel=1e-5)
    for x, y in zip(g1, g2, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_a_warmup_not_below_the_run_is_cut_to_a_tenth_so_the_peak_is_reached() -> None:
    assert [effective_warmup(50, t) for t in (51, 50, 20, 3, 1)] == [50, 5, 2, 1, 1]
    assert effective_warmup(0, 5) == 0
    got = [lr_at(s, 1.0, 50, 20, "cosine") for s in range(20)]
    assert got[:2] == [0.5, 1.0] and max(got) == 1.0 and got[-1] < got[2]
