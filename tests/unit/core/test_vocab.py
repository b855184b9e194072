"""Draft vocabulary and the mask-token rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle_pipeline.core.vocab import build_draft_vocab, choose_mask_token_id
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


def test_mask_token_rule():
    assert choose_mask_token_id(7, 400, 512, 0, 1) == (7, None)
    assert choose_mask_token_id(None, 400, 512, 0, 1) == (400, None)  # first unused embedding row
    mid, warn = choose_mask_token_id(None, 512, 512, 3, 1)
    assert mid == 3 and "pad" in warn
    mid, warn = choose_mask_token_id(None, 512, 512, None, 1)
    assert mid == 1 and "eos" in warn
    with pytest.raises(BadInput):
        choose_mask_token_id(None, 512, 512, None, None)
