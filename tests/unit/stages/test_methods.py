"""The drafting methods' own parts of a step (`stages.train.methods`): draft class, layout, per-step loss weights."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.config import TrainConfig
from peagle_pipeline.core.eagle3 import Eagle3Draft
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.errors import BadConfig
from peagle_pipeline.stages.train.methods import method_for


def test_each_method_names_its_draft_and_layout() -> None:
    peagle, eagle3 = method_for("peagle"), method_for("eagle3")
    assert peagle.model_class is PEagleDraft and not peagle.full_chains and peagle.uses_mask_token
    assert eagle3.model_class is Eagle3Draft and eagle3.full_chains and not eagle3.uses_mask_token
    with pytest.raises(BadConfig, match="unknown method 'medusa'"):
        method_for("medusa")


def test_eagle3_weighs_step_d_by_the_decay_to_the_power_d() -> None:
    depth = torch.tensor([0, 1, 2, 3, 2])
    valid = torch.tensor([True, True, True, True, False])
    cfg = TrainConfig(cache="c", output="o", method="eagle3", step_loss_decay=0.5)
    w = method_for("eagle3").loss_weight(cfg, depth, valid)
    assert w.tolist() == [1.0, 0.5, 0.25, 0.125, 0.0]
    plain = TrainConfig(cache="c", output="o", method="eagle3")
    assert torch.equal(method_for("eagle3").loss_weight(plain, depth, valid), valid)
    assert torch.equal(method_for("peagle").loss_weight(cfg, depth, valid), valid)
