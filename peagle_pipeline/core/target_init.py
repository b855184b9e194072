"""Starting a draft from the target's own weights instead of random ones (`train --init-from-target`).

The fused layer 0 of a P-EAGLE draft reads cat(input_layernorm(embeds), hidden_norm(fc(aux))) and keeps fc(aux)
as its residual. At the start of training:

- `fc` passes the last aux state through (identity on its block, zero on the others), so the residual stream
  begins as a hidden state of the target that its final norm and lm_head (frozen in the draft) already read;
- the layer's attention projections on the hidden half, its output projection, MLP and norms are the target's
  last decoder layer. The projections of the embedding half of the attention input start at zero: the target
  has no counterpart for them, and random ones only add noise to the target layer's attention.

The draft so starts as exactly the target layer on the last aux state, instead of noise, and learns to read the
token and the shift to the token after the next (and the parallel depths) from there. The embedding half's
projections get their gradient from the first step (dL/dW = dL/dq x normed embedding), so they grow as the
draft needs them. Which layer to copy was measured on SmolLM2-135M (aux layers 2, 15, 27;
trainer's held-out estimate after 300 steps): the last layer (29) 1.366, layer 27 (the one that reads the last
aux state) 1.337, layer 20 1.310, fc pass-through alone 1.315, random 1.274; also copying the target's
projections into the embedding half: 1.285. With the embedding half at zero instead of random: 1.385 against 1.379
(a later screen on another cache). docs/results/what-we-learned.md has the figures and vLLM's.

A mixture-of-experts layer (gpt-oss, Qwen3-MoE) has no Llama MLP to copy: its attention and norms are copied, and the
draft's MLP starts at zero output, so the draft starts as the target layer's attention on the last aux state.
Pure torch, no I/O.
"""

from __future__ import annotations

from typing import Any

import torch

from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.errors import BadInput

__all__ = ["target_init_layer", "init_from_target_layer"]


def target_init_layer(num_hidden_layers: int) -> int:
    """The target decoder layer a draft starts from: the last one (measured best, see the module docstring)."""
    return num_hidden_layers - 1


@torch.no_grad()
def init_from_target_layer(model: PEagleDraft, layer: dict[str, torch.Tensor]) -> None:
    """Copy a target decoder layer into the draft's fused layer 0, zero its embedding half's projections and make
    `fc` pass the last aux state through.

    Args:
        model: a PEagleDraft (hidden size H, n_aux aux states).
        layer: the target layer's tensors keyed by Llama names: input_layernorm.weight [H],
            post_attention_layernorm.weight [H], self_attn.{q,k,v}_proj.weight [heads*D, H],
            self_attn.o_proj.weight [H, heads*D], mlp.{gate,up}_proj.weight [I, H], mlp.down_proj.weight [H, I];
            self_attn.{q,k,v,o}_proj.bias when the target has them; self_attn.{q,k}_norm.weight [D] (Qwen3),
            required when the draft has QK-norm (`DraftConfig.qk_norm`). Without any of the three MLP tensors
            (a mixture-of-experts layer: gpt-oss, Qwen3-MoE) the draft's MLP starts at zero output instead
            (down_proj zero): the draft starts as the target layer's attention on the last aux state.

    Raises:
        BadInput: a tensor is missing or its shape does not fit the draft (another architecture or size).
    """
    H = model.cfg.hidden_size
    first: Any = model.layers[0]  # the fused DecoderLayer
    attn: Any = first.self_attn
    # (draft parameter, target tensor name, the draft parameter's columns the tensor fills)
    plan: list[tuple[torch.Tensor, str, slice | None]] = [
        (attn.q_proj.weight, "self_attn.q_proj.weight", slice(H, 2 * H)),
        (attn.k_proj.weight, "self_attn.k_proj.weight", slice(H, 2 * H)),
        (attn.v_proj.weight, "self_attn.v_proj.weight", slice(H, 2 * H)),
        (attn.o_proj.weight, "self_attn.o_proj.weight", None),
        (first.hidden_norm.weight, "input_layernorm.weight", None),
        (first.post_attention_layernorm.weight, "post_attention_layernorm.weight", None),
    ]
    mlp_names = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    if any(name in layer for name in mlp_names):
        plan += [(getattr(first.mlp, name.split(".")[1]).weight, name, None) for name in mlp_names]
    else:  # a mixture of experts: no Llama MLP to copy; the draft's MLP adds nothing until it learns to
        first.mlp.down_proj.weight.zero_()
        if first.mlp.down_proj.bias is not None:
            first.mlp.down_proj.bias.zero_()
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        bias = getattr(attn, proj).bias
        if bias is not None and f"self_attn.{proj}.bias" in layer:
            plan.append((bias, f"self_attn.{proj}.bias", None))
    if (
        attn.qk_norm
    ):  # a Qwen3 draft layer takes the target's per-head query/key norms (a Qwen3 target has them)
        plan += [(attn.q_norm.weight, "self_attn.q_norm.weight", None)]
        plan += [(attn.k_norm.weight, "self_attn.k_norm.weight", None)]
    for param, name, cols in plan:
        if name not in layer:
            raise BadInput(f"target layer tensors lack {name!r}")
        dest = param if cols is None else param[:, cols]
        src = layer[name]
        if tuple(src.shape) != tuple(dest.shape):
            raise BadInput(
                f"target layer tensor {name} has shape {tuple(src.shape)}, the draft needs {tuple(dest.shape)}"
            )
        dest.copy_(src.to(dest.dtype))
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.weight[:, :H] = 0  # the embedding half: no target counterpart
    fc: torch.Tensor = model.fc.weight  # [H, n_aux * H]
    fc.zero_()
    fc[:, fc.shape[1] - H :] = torch.eye(H, dtype=fc.dtype)
