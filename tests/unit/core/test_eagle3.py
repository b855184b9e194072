"""The EAGLE-3 draft's training-time test (`core.eagle3`): the K steps of a packed row, run at once, equal vLLM's
way of drafting one chain at a time (step 0 over the context with a causal mask, then one query per step that
reads the previous step's pre-norm output and the keys and values of the context and of its own earlier steps),
teacher-forced and greedy; and the draft's weights are P-EAGLE's without `mask_hidden`."""

from __future__ import annotations

import pytest
import torch

from bench.reference_step import tiny_batch, tiny_draft
from peagle_pipeline.core.cod import CODConfig, build_layout
from peagle_pipeline.core.eagle3 import Eagle3Draft, step_parents, ttt_inputs
from peagle_pipeline.errors import BadInput

H, V, K = 64, 512, 4
DOCS = [13, 9]


def _draft(layers: int = 2) -> Eagle3Draft:
    peagle, vocab, pieces = tiny_draft(seed=3, layers=layers)
    model = Eagle3Draft(peagle.cfg, pieces, vocab, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # larger matrices: deeper steps then depend visibly on their inputs
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.startswith(("layers.", "fc.")):
                p.mul_(4.0)
    return model.eval()


def _chain(
    model: Eagle3Draft, tokens, aux, start: int, anchor: int, steps: int, greedy: bool
) -> list[torch.Tensor]:
    """Final-normed outputs of steps 0..steps-1 at `anchor` (a row of the sample starting at row `start`), drafted
    as vLLM drafts them: step 0 over rows start..anchor (causal), then one position at a time."""
    rows = torch.arange(start, anchor + 1)
    n = rows.numel()
    cos, sin = model.rope(rows - start)
    stream, embeds = model.fc(aux[rows]), model.embed_tokens(tokens[rows])
    kv = []
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i, layer in enumerate(model.layers):
        e = embeds if i == 0 else None
        kv.append(layer.kv(stream, e, cos, sin))
        stream = layer(stream, e, cos, sin, causal)
    state = stream[-1:]
    outs = [model.norm(state)]
    for d in range(1, steps):
        token = model.drafted(outs[-1]) if greedy else tokens[anchor + d : anchor + d + 1]
        cos, sin = model.rope(torch.tensor([anchor - start + d]))
        embeds = model.embed_tokens(token)
        for i, layer in enumerate(model.layers):
            e = embeds if i == 0 else None
            k, v = layer.kv(state, e, cos, sin)
            kv[i] = (torch.cat([kv[i][0], k]), torch.cat([kv[i][1], v]))
            state = layer(state, e, cos, sin, torch.ones(1, kv[i][0].shape[0], dtype=torch.bool), kv[i])
        outs.append(model.norm(state))
    return outs


@pytest.mark.parametrize("greedy", [False, True])
def test_steps_at_once_equal_drafting_one_chain_at_a_time(greedy: bool) -> None:
    model = _draft()
    tokens, aux, weight, _, _ = tiny_batch(1, DOCS, 24, V, 3 * H, p_valid=0.8)
    lay = build_layout(DOCS, weight, CODConfig(depths=K), None, full=True)
    assert int(lay.depth.max()) == K - 1  # the row holds chains to full depth
    with torch.no_grad():
        hidden = model(**ttt_inputs(lay, tokens, aux), greedy=greedy)
        assert hidden.shape == (len(lay), H)
        starts = [0, DOCS[0]]
        checked = 0
        for e in range(len(lay)):
            a, d, doc = int(lay.anchor[e]), int(lay.depth[e]), int(lay.doc[e])
            if doc < 0:
                continue
            ref = _chain(model, tokens, aux, starts[doc], a, d + 1, greedy)[d][0]
            assert torch.allclose(hidden[e], ref, atol=1e-4), (a, d)
            checked += d > 0
        assert checked > 10
        # deeper steps read their inputs: a random token at depth >= 1 changes their outputs (teacher forcing)
        if not greedy:
            other = tokens.clone()
            other[DOCS[0] - 2] = (other[DOCS[0] - 2] + 1) % V
            moved = model(**ttt_inputs(lay, other, aux))
            deep = (lay.depth > 0) & (lay.target == DOCS[0] - 2)
            assert deep.any() and not torch.allclose(moved[deep], hidden[deep], atol=1e-3)


def test_gradient_reaches_step_zero_through_the_steps() -> None:
    model = _draft(layers=1).train()
    tokens, aux, weight, _, _ = tiny_batch(2, DOCS, 24, V, 3 * H, p_valid=0.8)
    lay = build_layout(DOCS, weight, CODConfig(depths=K), None, full=True)
    hidden = model(**ttt_inputs(lay, tokens, aux))
    deepest = lay.depth == K - 1
    hidden[deepest].sum().backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0  # fc runs at step 0 only


def test_weights_are_peagles_without_mask_hidden() -> None:
    peagle, _, _ = tiny_draft(seed=3, layers=2)
    model = _draft()
    assert set(model.state_dict()) == set(peagle.state_dict()) - {"mask_hidden"}
    assert not hasattr(model, "mask_hidden")


def test_a_layout_with_broken_chains_is_refused() -> None:
    _, _, weight, _, _ = tiny_batch(1, DOCS, 24, V, 3 * H)
    lay = build_layout(DOCS, weight, CODConfig(depths=K), None, full=True)
    assert [p.numel() for p in step_parents(lay)] == lay.depth_counts(K)[1:]
    first = int(torch.nonzero(lay.depth == 1)[0])  # drop one chain's step 1, keep its step 2
    assert bool(((lay.depth == 2) & (lay.anchor == lay.anchor[first])).any())
    broken = lay.select(torch.tensor([i for i in range(len(lay)) if i != first]))
    with pytest.raises(BadInput, match="do not all continue"):
        step_parents(broken)
