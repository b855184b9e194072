"""The comparison behind the "a started draft is the target's layer" tests: the draft's output on the last aux
state against a transformers decoder layer run on that state with the same positions, causally; and the random
transformers layer of a target config at the tiny draft's sizes that they compare with."""

from __future__ import annotations

from typing import Any

import torch


def draft_and_target_layer(
    model: Any, layer: Any, rotary: Any, vocab_size: int, hidden: int
) -> tuple[Any, Any]:
    """(the draft's output, the target layer's output through the draft's final norm), both [N, H], for 6 tokens
    at positions 0, 7, 14, ... with random aux states [N, 3H] (the layer sees the last H of them)."""
    n = 6
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(n, 3 * hidden, generator=g)
    pos = torch.arange(n) * 7
    with torch.no_grad():
        ours = model(
            input_ids=torch.randint(0, vocab_size, (n,), generator=g),
            aux_hidden=aux,
            is_mask=torch.zeros(n, dtype=torch.bool),
            position=pos,
            attn_mask=torch.ones(n, n, dtype=torch.bool).tril(),
        )
        h = aux[None, :, 2 * hidden :]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(h, position_embeddings=rotary(h, pos[None]), attention_mask=causal)
        out = out[0] if isinstance(out, tuple) else out
        return ours, model.norm(out[0])


def random_decoder_layer(config_class: Any, layer_class: Any, **config: Any) -> tuple[Any, Any]:
    """(a transformers decoder layer of `layer_class` with random weights, norms near 1, and its config): one layer
    at `bench.reference_step.tiny_target_config`'s sizes, eager attention, `config` on top."""
    from bench.reference_step import tiny_target_config

    base = tiny_target_config()
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    cfg = config_class(**{k: base[k] for k in sizes}, num_hidden_layers=1, rms_norm_eps=1e-6, **config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = layer_class(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return layer, cfg
