"""core.target_init: a draft started from a target decoder layer is, before training, exactly that layer applied to
the last aux state whatever the token (checked against transformers' own Llama layer), and mismatched tensors are
refused."""

from __future__ import annotations

import pytest
import torch

from bench.reference_step import tiny_draft, tiny_target_config
from peagle_pipeline.core.target_init import init_from_target_layer, target_init_layer
from peagle_pipeline.errors import BadInput


def _llama_layer(cfg: dict, seed: int = 0):
    """A transformers decoder layer of `cfg`'s model type (Llama, or Qwen2: q/k/v biases, none on o) and its RoPE."""
    if cfg.get("model_type") == "qwen2":
        from transformers import Qwen2Config as Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as Layer
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as Rope
    else:
        from transformers import LlamaConfig as Config
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rope

    config = Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = Layer(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))  # norms near 1
    return layer, Rope(config)


def _started_and_wanted(model, layer, rope, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The started draft's output on random aux states, and the target layer's on their last block (normed)."""
    H, N = cfg["hidden_size"], 6
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(N, 3 * H, generator=g)
    pos = torch.arange(N)
    ours = model(
        input_ids=torch.randint(0, cfg["vocab_size"], (N,), generator=g),
        aux_hidden=aux,
        is_mask=torch.zeros(N, dtype=torch.bool),
        position=pos,
        attn_mask=torch.ones(N, N, dtype=torch.bool).tril(),
    )
    h = aux[None, :, 2 * H :]  # the last aux state, [1, N, H]
    causal = torch.full((N, N), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(h, attention_mask=causal, position_ids=pos[None], position_embeddings=rope(h, pos[None]))
    out = out[0] if isinstance(out, tuple) else out
    return ours, model.norm(out[0])


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_started_draft_is_the_target_layer_on_the_last_aux_state(model_type: str) -> None:
    cfg = {**tiny_target_config(), "model_type": model_type}
    H = cfg["hidden_size"]
    layer, rope = _llama_layer(cfg)
    model, _, _ = tiny_draft(config=cfg, draft_vocab=cfg["vocab_size"])
    init_from_target_layer(model, dict(layer.state_dict()))
    for proj in ("q_proj", "k_proj", "v_proj"):  # the embedding half has no target counterpart: zero
        assert not getattr(model.layers[0].self_attn, proj).weight[:, :H].any()
    ours, want = _started_and_wanted(model, layer, rope, cfg)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    model.logits(ours).logsumexp(-1).sum().backward()  # the zero half still learns from the first step
    for proj in ("q_proj", "k_proj", "v_proj"):
        grad = getattr(model.layers[0].self_attn, proj).weight.grad
        assert grad is not None and grad[:, :H].abs().sum() > 0


def test_a_mixture_of_experts_layer_starts_its_attention_and_a_silent_mlp() -> None:
    """Without the layer's MLP (gpt-oss, Qwen3-MoE) the draft starts as the layer with its MLP's output at zero."""
    cfg = tiny_target_config()
    layer, rope = _llama_layer(cfg)
    model, _, _ = tiny_draft(config=cfg, draft_vocab=cfg["vocab_size"])
    init_from_target_layer(model, {k: v for k, v in layer.state_dict().items() if not k.startswith("mlp.")})
    assert not model.layers[0].mlp.down_proj.weight.any()
    with torch.no_grad():
        layer.mlp.down_proj.weight.zero_()
    ours, want = _started_and_wanted(model, layer, rope, cfg)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    model.logits(ours).logsumexp(-1).sum().backward()  # the silent MLP learns from the first step
    assert model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_target_layer_rule_and_refusals() -> None:
    assert target_init_layer(30) == 29
    model, _, _ = tiny_draft()
    layer, _ = _llama_layer(tiny_target_config())
    tensors = dict(layer.state_dict())
    with pytest.raises(BadInput, match="lack 'mlp.up_proj.weight'"):
        init_from_target_layer(model, {k: v for k, v in tensors.items() if k != "mlp.up_proj.weight"})
    wide, _ = _llama_layer(tiny_target_config(inter=256))
    with pytest.raises(
        BadInput, match=r"mlp.gate_proj.weight has shape \(256, 64\), the draft needs \(128, 64\)"
    ):
        init_from_target_layer(model, dict(wide.state_dict()))
