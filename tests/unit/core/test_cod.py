"""COD sampling: closed-form depth sizes, chain structure, the two edge-case fixes, determinism, uniformity."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from peagle_pipeline.core.cod import CODConfig, build_layout, depth_sizes, full_chains, sample_chains
from peagle_pipeline.errors import BadConfig, BadInput


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_depth_counts_match_closed_form_with_large_pools():
    cfg = CODConfig(depths=8, max_anchors=None)
    valid = torch.ones(200, dtype=torch.bool)  # position 0 is excluded: 199 seeds
    chains = sample_chains(valid, cfg, _gen(0))
    assert [c.numel() for c in chains] == depth_sizes(199, cfg)
    assert depth_sizes(199, cfg) == [int((199 - d) * max(0.7**d, 0.2)) for d in range(1, 8)]


def test_stops_when_size_reaches_zero():
    cfg = CODConfig(depths=8, ratio=0.5, ratio_min=0.0, max_anchors=None)
    valid = torch.zeros(10, dtype=torch.bool)
    valid[2:6] = True  # 4 seeds: n_1 = int(3*0.5) = 1, n_2 = int(2*0.25) = 0 -> stop
    assert [c.numel() for c in sample_chains(valid, cfg, _gen(1))] == [1]


def _layout(seed: int = 0, cfg: CODConfig | None = None, docs=(30, 25, 20), L: int = 80, p: float = 0.8):
    g = _gen(seed)
    weight = torch.rand(L, generator=g) < p
    weight[sum(docs) :] = False
    weight[0] = weight[docs[0]] = True  # position 0 of two samples valid: the edge case the fix is about
    return build_layout(list(docs), weight, cfg or CODConfig(depths=6), _gen(seed + 100)), weight


def test_depth0_is_every_row_including_padding():
    lay, _ = _layout()
    assert torch.equal(lay.anchor[:80], torch.arange(80)) and bool((lay.depth[:80] == 0).all())
    assert torch.equal(lay.doc[75:80], torch.full((5,), -1))
    assert bool((lay.depth[80:] > 0).all()) and bool((lay.depth[80:].diff() >= 0).all())


def test_every_element_has_its_predecessor_and_targets_are_valid():
    lay, weight = _layout(seed=3)
    keys = set(zip(lay.anchor.tolist(), lay.depth.tolist(), strict=True))
    for a, d in keys:
        if d > 0:
            assert (a, d - 1) in keys
    deep = lay.depth > 0
    assert bool(weight[lay.target[deep]].all())  # depth >= 1 elements only predict weighted rows
    assert torch.equal(lay.target, lay.anchor + lay.depth)


def test_no_depth_ge1_element_at_sample_position_0_and_no_chain_crosses_samples():
    for seed in range(5):
        lay, _ = _layout(seed=seed)
        deep = lay.depth > 0
        assert bool((lay.position[deep] >= 1).all())
        assert bool((lay.position[deep] - lay.depth[deep] >= 0).all())  # anchor inside its own sample
        assert torch.equal(lay.doc[lay.anchor[deep]], lay.doc[deep])
        assert bool((lay.doc[deep] >= 0).all())


def test_max_anchors_bounds_depths_ge1_only():
    cfg = CODConfig(depths=5, max_anchors=10)
    weight = torch.ones(100, dtype=torch.bool)
    lay = build_layout([100], weight, cfg, _gen(0))
    assert lay.depth_counts(5)[0] == 100
    assert lay.depth_counts(5)[1:] == depth_sizes(10, cfg)
    chains = {a - 0 for a in lay.anchor[lay.depth > 0].tolist()}
    assert len(chains) <= 10


def test_same_generator_state_same_sample_and_other_state_differs():
    a, _ = _layout(seed=7)
    b, _ = _layout(seed=7)
    c = build_layout([30, 25, 20], _layout(seed=7)[1], CODConfig(depths=6), _gen(999))
    assert torch.equal(a.anchor, b.anchor) and torch.equal(a.depth, b.depth)
    assert not torch.equal(a.anchor, c.anchor) if len(a) == len(c) else True
    g = _gen(5)
    state = g.get_state()
    first = sample_chains(torch.ones(50, dtype=torch.bool), CODConfig(max_anchors=20), g)
    g.set_state(state)
    again = sample_chains(torch.ones(50, dtype=torch.bool), CODConfig(max_anchors=20), g)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))


def test_selection_is_uniform_chi_square():
    """Each of 20 usable positions is picked for depth 1 with probability 13/20 (fixed seed: deterministic)."""
    cfg = CODConfig(depths=2, max_anchors=None)
    valid = torch.ones(21, dtype=torch.bool)  # seeds = 1..20, n_1 = int(19 * 0.7) = 13
    g = _gen(1234)
    draws = 3000
    counts = torch.zeros(21)
    for _ in range(draws):
        counts[sample_chains(valid, cfg, g)[0]] += 1
    assert counts[0] == 0
    expected = draws * 13 / 20
    chi2 = float(((counts[1:] - expected) ** 2 / expected).sum())
    assert chi2 < 43.8, chi2  # df = 19, p = 0.001


def test_full_layout_is_deterministic_and_complete():
    weight = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0], dtype=torch.bool)
    cfg = CODConfig(depths=4)
    lay = build_layout([8], weight, cfg, None, full=True)
    assert full_chains(weight, 4)[0].tolist() == [1, 2, 3, 5, 6]
    assert full_chains(weight, 4)[1].tolist() == [2, 3, 6]
    assert full_chains(weight, 4)[2].tolist() == [3]
    assert lay.depth_counts(4) == [8, 5, 3, 1]
    again = build_layout([8], weight, cfg, None, full=True)
    assert torch.equal(lay.anchor, again.anchor)


def test_bad_inputs():
    with pytest.raises(BadInput):
        build_layout([10, 10], torch.ones(15, dtype=torch.bool), CODConfig(), _gen(0))
    with pytest.raises(BadInput):
        build_layout([5], torch.ones(5, dtype=torch.bool), CODConfig(), None)
    with pytest.raises(BadConfig):
        CODConfig(depths=0)


def _speculators_cod():
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "peagle" / "data.py"
    mod_spec = importlib.util.spec_from_file_location("_spec_peagle_data", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.generate_cod_sample_indices


@pytest.mark.speculators
@pytest.mark.parametrize("max_anchors", [None, 16])
def test_bit_identical_to_speculators_when_position0_invalid(max_anchors):
    """Runs in the benchmark env only (`make bench`), where speculators==0.9.0 is installed."""
    ref = _speculators_cod()
    assert ref is not None, "speculators==0.9.0 is not installed in this environment (make setup-bench)"
    g = _gen(11)
    valid = torch.rand(120, generator=g) < 0.6
    valid[0] = False
    cfg = CODConfig(depths=6, max_anchors=max_anchors)
    for seed in range(5):
        torch.manual_seed(seed)
        anchors, depth = ref(120, valid.float()[None], 6, 0.7, 0.2, True, max_anchors)
        ours = build_layout([120], valid, cfg, _gen(seed))
        assert torch.equal(ours.anchor, anchors) and torch.equal(ours.depth, depth)
