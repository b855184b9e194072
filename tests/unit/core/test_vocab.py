"""Draft vocabulary and the mask-token rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle_pipeline.core.vocab import TokenizerFacts, build_draft_vocab, choose_mask_token_id
from peagle_pipeline.errors import BadInput


def test_most_frequent_ties_by_id_sorted():
    v = build_draft_vocab(torch.tensor([5, 0, 9, 5, 1]), 2)
    assert v.ids.tolist() == [0, 2]
    assert v.d2t.tolist() == [0, 1] and v.d2t.dtype == torch.int64
    assert v.t2d.tolist() == [True, False, True, False, False] and v.t2d.dtype == torch.bool
    assert v.target_to_draft.tolist() == [0, -1, 1, -1, -1]
    assert torch.equal(torch.arange(2) + v.d2t, v.ids)
    v3 = build_draft_vocab(np.array([5, 0, 9, 5, 1]), 3)
    assert v3.ids.tolist() == [0, 2, 3]


def test_full_size_is_identity():
    v = build_draft_vocab(torch.tensor([3, 1, 2]), 10)
    assert v.is_identity and v.ids.tolist() == [0, 1, 2] and v.d2t.tolist() == [0, 0, 0]


def test_bad_sizes():
    with pytest.raises(BadInput):
        build_draft_vocab(torch.tensor([1, 2]), 0)
    with pytest.raises(BadInput):
        build_draft_vocab(torch.zeros(2, 2), 1)


def _facts(**kw):
    """Facts of a 512-token tokenizer (pad 3, eos 1, no mask or special tokens) with the given fields changed."""
    base = dict(
        length=512, mask_id=None, special_ids=(), reserved_ids=frozenset(), pad_id=3, eos_id=1, names={}
    )
    base.update(kw)
    return TokenizerFacts(**base)


def test_mask_token_rule_order():
    counts = torch.zeros(512, dtype=torch.long)
    # (1) explicit setting, (2) tokenizer mask token, (3) first unused embedding row
    assert choose_mask_token_id(_facts(mask_id=7), 512, counts, override=9).token_id == 9
    assert choose_mask_token_id(_facts(mask_id=7), 512, counts).token_id == 7
    assert choose_mask_token_id(_facts(length=400), 512, counts).token_id == 400
    # (4) lowest special token that is not reserved and never occurs in the data
    c = _facts(special_ids=(0, 1, 2, 5, 6, 8), reserved_ids=frozenset({0, 1, 2}))
    choice = choose_mask_token_id(c, 512, counts)
    assert (choice.token_id, choice.warning) == (5, None) and "special" in choice.rule
    counts[5] = 1  # seen in a sample (context or supervised): not a mask token
    assert choose_mask_token_id(c, 512, counts).token_id == 6
    counts[6] = 4
    assert choose_mask_token_id(c, 512, counts).token_id == 8


def test_mask_token_falls_back_to_pad_then_eos_with_a_warning():
    counts = torch.ones(512, dtype=torch.long)  # every special token occurs in the data
    choice = choose_mask_token_id(_facts(special_ids=(5,)), 512, counts)
    assert choice.token_id == 3 and "pad" in choice.warning
    choice = choose_mask_token_id(_facts(pad_id=None), 512, None)  # counts unknown: rule 4 is skipped
    assert choice.token_id == 1 and "eos" in choice.warning
    with pytest.raises(BadInput):
        choose_mask_token_id(_facts(pad_id=None, eos_id=None), 512, counts)


def test_mask_token_override_is_checked_and_warned_when_seen():
    counts = torch.zeros(512, dtype=torch.long)
    counts[9] = 2
    assert "occurs 2 times" in choose_mask_token_id(_facts(), 512, counts, override=9).warning
    with pytest.raises(BadInput):
        choose_mask_token_id(_facts(), 512, counts, override=512)
