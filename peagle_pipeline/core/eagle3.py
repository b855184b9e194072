"""The EAGLE-3 draft and its training-time test (TTT): K sequential steps over a packed row, each step's inputs
the previous step's outputs, as vLLM's EAGLE-3 proposer drafts (docs/reference/eagle3-algorithm.md).

Pure torch: no I/O, no global RNG. The parameters are those of the P-EAGLE draft (`core.model.PEagleDraft`: the
same embeddings, fc, fused layer 0, later layers, final norm and lm_head) without `mask_hidden`, so the shared
layers, initialisation and checkpoints are one code. Elements are those of a full-depth layout
(`core.cod.build_layout(full=True)`): element (a, d) is step d of the chain anchored at packed row a, predicts the
target of row a + d, and sits at RoPE position pos(a) + d.

- Step 0 runs every row: token x_{i+1} (shifted row i) and fc(aux states of row i).
- Step d >= 1 runs the chains' elements of depth d: token = the token step d - 1 drafted there (training feeds
  the true token of row a + d, which is what a verified draft holds; `greedy=True` feeds the draft's own argmax,
  as serving does), hidden input = the pre-norm output of element (a, d - 1) (no fc: it is already H wide).
- Attention: a step attends to the keys and values of every earlier step's elements it may see and its own,
  by the P-EAGLE predicate (`core.mask.allowed`): depth-0 keys of its sample up to the anchor, and its own chain so
  far. That is what vLLM's KV cache holds when it drafts step d at the anchor.

Worked example (the full layout of one sample of 4 valid rows, K = 3: depth 0 rows 0..3, depth 1 anchors 0..2,
depth 2 anchors 0..1): `ttt_inputs` gives parents [[0, 1, 2], [0, 1]] (each depth-d element's depth d - 1
element, counted within that depth) and three masks of shapes [4, 4], [3, 7] and [2, 9]; `forward` returns
[9, H] in layout order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from peagle_pipeline.core.cod import CODLayout
from peagle_pipeline.core.mask import AttnMask, build_mask
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.errors import BadInput

__all__ = ["Eagle3Draft", "step_parents", "step_masks", "ttt_inputs"]


class Eagle3Draft(PEagleDraft):
    """EAGLE-3 draft: the P-EAGLE draft's layers run as K sequential steps (no `mask_hidden`, no mask token)."""

    HAS_MASK_HIDDEN = False

    def forward(  # type: ignore[override]  # another method's forward: its own inputs
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position: torch.Tensor,
        masks: list[AttnMask],
        parents: list[torch.Tensor],
        greedy: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states of every step's elements, in layout order (depth 0 first).

        Args:
            input_ids: LongTensor[N], each element's token (read at depth 0 only when `greedy`).
            aux_hidden: [n_0, n_aux*H] aux states of the depth-0 elements (any float dtype).
            position: LongTensor[N], RoPE positions.
            masks: per step d, the mask [n_d, n_0 + ... + n_d] of its queries over the keys of steps 0..d.
            parents: per step d >= 1, LongTensor[n_d]: the index, within step d - 1, of each element's predecessor.
            greedy: feed each step the previous step's argmax (mapped to target ids), as serving does.

        Returns:
            [N, H].
        """
        sizes = [int(aux_hidden.shape[0])] + [int(p.numel()) for p in parents]
        past: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        outs: list[torch.Tensor] = []
        stream = torch.empty(0)
        lo = 0
        for d, n in enumerate(sizes):
            if n == 0:  # full chains are nested: every deeper step is empty too
                break
            if d == 0:
                aux = aux_hidden
                if not torch.is_autocast_enabled(aux.device.type):
                    aux = aux.to(self.fc.weight.dtype)
                stream, ids = self.fc(aux), input_ids[:n]
            else:
                stream = stream[parents[d - 1]]
                ids = self.drafted(outs[-1][parents[d - 1]]) if greedy else input_ids[lo : lo + n]
            embeds = self.embed_tokens(ids)
            cos, sin = self.rope(position[lo : lo + n])
            for i in range(len(self.layers)):
                stream, past[i] = self._step_layer(
                    i, stream, embeds if i == 0 else None, cos, sin, masks[d], past[i]
                )
            outs.append(self.norm(stream))
            lo += n
        return torch.cat(outs)

    def _step_layer(
        self,
        i: int,
        stream: torch.Tensor,
        embeds: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttnMask,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Layer i of one step: (its pre-norm output, the keys and values of steps 0..this one)."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            out, k, v = checkpoint(
                self._layer_step, i, stream, embeds, (cos, sin), mask, past, use_reentrant=False
            )
        else:
            out, k, v = self._layer_step(i, stream, embeds, (cos, sin), mask, past)
        return out, (k, v)

    def _layer_step(
        self,
        i: int,
        stream: torch.Tensor,
        embeds: torch.Tensor | None,
        rot: tuple[torch.Tensor, torch.Tensor],
        mask: AttnMask,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i over this step's elements (`rot`: their RoPE cos and sin): its output and the keys and values of
        the steps so far (`past`, then this one's)."""
        layer = self.layers[i]
        cos, sin = rot
        k, v = layer.kv(stream, embeds, cos, sin)  # type: ignore[operator]
        if past is not None:
            past_k, past_v = past
            k, v = torch.cat([past_k, k.to(past_k.dtype)]), torch.cat([past_v, v.to(past_v.dtype)])
        return layer(stream, embeds, cos, sin, mask, (k, v)), k, v

    def drafted(self, hidden: torch.Tensor) -> torch.Tensor:
        """LongTensor[n]: the target-vocabulary ids of the argmax tokens of final-normed `hidden` [n, H]."""
        best = self.lm_head(hidden.to(self.lm_head.weight.dtype)).argmax(-1)
        d2t: Any = getattr(self, "d2t", None)
        return best if d2t is None else best + d2t[best]

    def forward_layout(  # type: ignore[override]
        self, layout: CODLayout, tokens: torch.Tensor, aux_rows: torch.Tensor, greedy: bool = False
    ) -> torch.Tensor:
        """Forward for a full-depth layout of a packed row, every input gathered from its rows (`ttt_inputs`)."""
        return self.forward(**ttt_inputs(layout, tokens, aux_rows), greedy=greedy)


def step_parents(layout: CODLayout) -> list[torch.Tensor]:
    """Per depth d >= 1 with elements (and the empty ones before the end of K), LongTensor[n_d]: the index within
    depth d - 1 of element (a, d - 1) for each element (a, d).

    Raises:
        BadInput: a chain misses an earlier step (not a full-depth layout).
    """
    depth = layout.depth
    K = int(depth.max()) + 1 if len(layout) else 1
    out = []
    for d in range(1, K):
        prev, here = layout.anchor[depth == d - 1], layout.anchor[depth == d]
        index = torch.searchsorted(prev, here).clamp(max=max(prev.numel() - 1, 0))
        if here.numel() and (prev.numel() == 0 or not bool((prev[index] == here).all())):
            raise BadInput(f"the layout's depth-{d} chains do not all continue a depth-{d - 1} element")
        out.append(index)
    return out


def step_masks(layout: CODLayout, device: torch.device | str) -> list[AttnMask]:
    """Per step d, the mask of its elements (queries) over the elements of steps 0..d (keys), on `device` (a
    BlockMask on CUDA, dense elsewhere: `core.mask.build_mask`)."""
    sizes = layout.depth_counts(int(layout.depth.max()) + 1 if len(layout) else 1)
    out, lo = [], 0
    for n in sizes:
        keys = layout.select(torch.arange(lo + n, device=layout.depth.device))
        out.append(build_mask(keys, device, torch.arange(lo, lo + n, device=layout.depth.device)))
        lo += n
    return out


def ttt_inputs(layout: CODLayout, tokens: torch.Tensor, aux_rows: torch.Tensor) -> dict[str, Any]:
    """Keyword inputs of `Eagle3Draft.forward` (all but `greedy`) for a full-depth layout of a packed row.

    Args:
        layout: full-depth elements (depth-0 elements = the L rows, in order); tokens: LongTensor[L] shifted tokens;
        aux_rows: [L, n_aux*H] aux states.
    """
    rows = layout.rows
    return {
        "input_ids": tokens[layout.target],
        "aux_hidden": aux_rows[layout.target[:rows]],
        "position": layout.position,
        "masks": step_masks(layout, tokens.device),
        "parents": step_parents(layout),
    }
