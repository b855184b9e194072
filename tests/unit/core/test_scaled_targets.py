"""Targets that scale what Llama does not: Granite's attention and residual multipliers and logit divisor, Cohere's
logit scale (core.target_convention). A draft started from a Granite layer is that layer (against transformers'
GraniteDecoderLayer), and the final norm carries the logit scale; a final LayerNorm refuses the exact target."""

from __future__ import annotations

import pytest
import torch
from layer_compare import draft_and_target_layer, random_decoder_layer

from peagle_pipeline.core.draft_config import DraftConfig
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.core.target_convention import (
    exact_target_refusal,
    layer_in_draft_convention,
    logit_scale,
    pieces_in_draft_convention,
)
from peagle_pipeline.core.target_init import init_from_target_layer

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:  # our range admits 4.56+; the layer API compared is v5's
    pytest.skip(
        f"compares transformers 5 modules (found {transformers.__version__})", allow_module_level=True
    )

# Granite 3.x's multipliers (granite-3.3-8b-instruct: 0.0078125, 0.22, 12, 16), at the tiny model's head size
GRANITE = dict(
    attention_multiplier=0.05, residual_multiplier=0.22, embedding_multiplier=12.0, logits_scaling=16.0
)


def test_a_draft_started_from_a_granite_layer_is_that_layer():
    from transformers import GraniteConfig
    from transformers.models.granite.modeling_granite import GraniteDecoderLayer, GraniteRotaryEmbedding

    layer, config = random_decoder_layer(GraniteConfig, GraniteDecoderLayer, **GRANITE)
    target, H = config.to_dict(), config.hidden_size
    cfg = DraftConfig.from_target_config(target, 1, 3, config.vocab_size, 500)
    rotary = GraniteRotaryEmbedding(config)

    def started(tensors: dict) -> tuple[torch.Tensor, torch.Tensor]:
        model = PEagleDraft(cfg, None, None, generator=torch.Generator().manual_seed(0))
        init_from_target_layer(model, tensors)
        return draft_and_target_layer(model, layer, rotary, config.vocab_size, H)

    ours, theirs = started(layer_in_draft_convention(dict(layer.state_dict()), target))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    unfolded, _ = started(dict(layer.state_dict()))  # the multipliers left out: another layer
    assert (unfolded - theirs).abs().max() > 0.1


def test_the_logit_scale_is_folded_into_the_final_norm():
    """lm_head(norm(h)) with the pieces in the draft's convention are the target's logits: Granite's divided by
    logits_scaling, Cohere's multiplied by logit_scale; others unchanged (the same dict)."""
    norm = torch.tensor([1.0, 2.0])
    pieces = {
        "norm.weight": norm,
        "lm_head.weight": torch.ones(3, 2),
        "embed_tokens.weight": torch.ones(3, 2),
    }
    granite = {"model_type": "granite", "logits_scaling": 8.0}
    assert (
        logit_scale(granite) == 0.125
        and logit_scale({"model_type": "cohere", "logit_scale": 0.0625}) == 0.0625
    )
    assert torch.equal(
        pieces_in_draft_convention(pieces, granite)["norm.weight"], torch.tensor([0.125, 0.25])
    )
    assert pieces_in_draft_convention(pieces, {"model_type": "llama"}) is pieces
    # a multimodal checkpoint's language model says it under text_config
    assert logit_scale({"model_type": "x", "text_config": granite}) == 0.125


def test_the_exact_target_is_refused_where_it_cannot_be_computed():
    assert exact_target_refusal({"model_type": "llama"}) is None
    assert (
        exact_target_refusal({"model_type": "granite", "logits_scaling": 16.0}) is None
    )  # folded in the norm
    assert "soft-caps" in exact_target_refusal({"model_type": "gemma2", "final_logit_softcapping": 30.0})
    for model_type in ("cohere", "stablelm", "starcoder2", "phimoe", "nemotron"):
        assert "LayerNorm" in exact_target_refusal({"model_type": model_type})
