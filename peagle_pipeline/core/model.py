"""The P-EAGLE draft model (docs/reference/algorithm.md), built from the target's config dict and its saved pieces.

Pure torch: no I/O, never loads the target model, no global RNG (initialisation takes a `torch.Generator`).
Matches vLLM's `llama_eagle3` runtime: fused layer 0 sees cat(input_layernorm(embeds), hidden_norm(fc(aux)))
with residual fc(aux) (or the normed hidden with `norm_before_residual`), plain pre-norm Llama layers after,
a final norm, and logits from a frozen lm_head over the draft vocabulary. Depth >= 1 elements get
`mask_token_id` as token and `mask_hidden` as aux states (before `fc`, as vLLM's combine_hidden_states does).
`state_dict()` keys are exactly the exported weight names (docs/reference/checkpoint-format.md). Sizes: `core.draft_config`; layers:
`core.draft_layers`; RoPE: `core.rope`.

Worked example (the packed row of the core/cod.py example: L = 7 rows, 10 elements, targets
[0, 1, 2, 3, 4, 5, 6, 2, 4, 5]): `layout_inputs` gives input_ids = tokens[target] [10], aux_hidden = the 7 depth-0
rows [7, n_aux*H] (fc runs on those 7 only), aux_index = [0, 1, 2, 3, 4, 5, 6, 0, 0, 0] and is_mask True at
elements 7, 8, 9 (they get `mask_token_id` and `mask_hidden`); `forward` returns [10, H], or [Nq, H] for the
elements of `out_index`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from peagle_pipeline.core.cod import CODLayout
from peagle_pipeline.core.draft_config import DraftConfig
from peagle_pipeline.core.draft_layers import DecoderLayer, RMSNorm
from peagle_pipeline.core.mask import AttnMask
from peagle_pipeline.core.rope import rope_inv_freq
from peagle_pipeline.core.vocab import DraftVocab
from peagle_pipeline.errors import BadInput

__all__ = ["PEagleDraft", "Owned", "KV_CHUNK", "layout_inputs"]


class Owned(NamedTuple):
    """The elements of a forward whose outputs are wanted (a sequence segment's own), `elements` LongTensor[Nq],
    and their attention mask `mask` [Nq, N] over all N elements."""

    elements: torch.Tensor
    mask: AttnMask | None


# Elements per checkpointed piece of layer 0's context keys and values (`PEagleDraft._context_kv`): bounds the
# embeddings, fc output and norms (about 14 KB an element for SmolLM2 in fp32) that forward and the recomputation
# in backward materialise at once.
KV_CHUNK = 2048


class PEagleDraft(nn.Module):
    """P-EAGLE draft: embeddings, fc over aux states, fused layer 0 (+ plain layers), final norm, lm_head.

    Args:
        cfg: sizes and settings.
        pieces: target tensors `embed_tokens.weight` [V, H], `lm_head.weight` [V, H], `norm.weight` [H]
            (embeddings, lm_head rows and final norm are initialised from them); None = random init.
        vocab: draft vocabulary (None = identity, Vd = V).
        generator: randomness for the initialisation of everything not taken from `pieces`.
        grad_checkpointing: recompute each layer in backward.
    """

    inv_freq: torch.Tensor  # [rotary_dim / 2] RoPE inverse frequencies (a non-persistent buffer)
    # Whether the draft has `mask_hidden` (P-EAGLE's state for depth >= 1 slots); a draft whose later steps read
    # its own output states (`core.eagle3.Eagle3Draft`) has none.
    HAS_MASK_HIDDEN = True

    def __init__(
        self,
        cfg: DraftConfig,
        pieces: dict[str, torch.Tensor] | None = None,
        vocab: DraftVocab | None = None,
        generator: torch.Generator | None = None,
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if vocab is not None and (vocab.target_size != cfg.vocab_size or vocab.size != cfg.draft_vocab_size):
            raise BadInput(
                f"draft vocabulary ({vocab.size} of {vocab.target_size}) does not match the draft "
                f"config ({cfg.draft_vocab_size} of {cfg.vocab_size})"
            )
        if vocab is None and cfg.draft_vocab_size != cfg.vocab_size:
            raise BadInput("a draft vocabulary smaller than the target needs a DraftVocab")
        self.cfg, self.grad_checkpointing = cfg, grad_checkpointing
        H = cfg.hidden_size
        with torch.device("meta"):  # no global-RNG init: every tensor is filled below
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.fc = nn.Linear(cfg.aux_size, H, bias=False)
            self.layers = nn.ModuleList([DecoderLayer(cfg, fused=i == 0) for i in range(cfg.num_layers)])
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
            if self.HAS_MASK_HIDDEN:
                self.mask_hidden = nn.Parameter(torch.empty(1, 1, cfg.aux_size))
        self.to_empty(device="cpu")
        if vocab is not None and not vocab.is_identity:
            self.register_buffer("d2t", vocab.d2t.clone())
            self.register_buffer("t2d", vocab.t2d.clone())
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        self._init_weights(generator, pieces, vocab)
        self.lm_head.weight.requires_grad_(False)

    @torch.no_grad()
    def _init_weights(
        self, g: torch.Generator | None, pieces: dict[str, torch.Tensor] | None, vocab: DraftVocab | None
    ) -> None:
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "mask_hidden":
                p.normal_(0.0, 1.0, generator=g)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
        if pieces is None:
            return
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        expect = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,)}
        for key, shape in expect.items():
            if key not in pieces:
                raise BadInput(f"target pieces lack {key!r}")
            if tuple(pieces[key].shape) != shape:
                raise BadInput(f"target piece {key} has shape {tuple(pieces[key].shape)}, expected {shape}")
        self.embed_tokens.weight.copy_(pieces["embed_tokens.weight"].float())
        head = pieces["lm_head.weight"].float()
        self.lm_head.weight.copy_(head if vocab is None else head[vocab.ids])
        self.norm.weight.copy_(pieces["norm.weight"].float())

    def rope(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [N, 1, R] (fp32) for LongTensor[N] positions (times yarn's attention factor, as vLLM's); R is
        the rotary dimension (head_dim unless the target's rotary is partial)."""
        freqs = position.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [N, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        scale = self.cfg.rope.attention_factor
        if scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * scale, emb.sin() * scale

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        is_mask: torch.Tensor,
        position: torch.Tensor,
        attn_mask: AttnMask,
        aux_index: torch.Tensor | None = None,
        owned: Owned | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of the COD elements.

        Args:
            input_ids: LongTensor[N], real tokens (ignored where `is_mask`: `mask_token_id` is used).
            aux_hidden: [N, n_aux*H] aux states of each element (ignored where `is_mask`), any float dtype;
                or [R, n_aux*H] rows with `aux_index` LongTensor[N] picking each element's row (saves
                fc work and memory: fc runs on R rows).
            is_mask: BoolTensor[N], True at depth >= 1.
            position: LongTensor[N], RoPE positions.
            attn_mask: [N, N] bool or BlockMask (used by every layer; by all but the last when `owned`).
            owned: the elements whose outputs are wanted (`Owned.elements` LongTensor[Nq]) and their mask [Nq, N]:
                the last layer computes only their queries (keys/values still come from all N elements).

        Returns:
            [N, H] (or [Nq, H]) after the final norm.
        """
        out_index, out_mask = owned if owned is not None else (None, None)
        ids = torch.where(is_mask, torch.full_like(input_ids, self.cfg.mask_token_id), input_ids)
        cos, sin = self.rope(position)
        last = len(self.layers) - 1
        if out_index is not None and last == 0:
            # Only the owned queries go through the layer; the keys/values of all N elements are checkpointed
            # from the raw inputs, so the many context rows keep just k and v alive (not embeddings, aux, norms).
            kv = self._context_kv(ids, aux_hidden, is_mask, aux_index, cos, sin)
            embeds, stream = self._layer0_inputs(ids, aux_hidden, is_mask, aux_index, out_index)
            stream = self._run_layer(0, stream, embeds, cos[out_index], sin[out_index], out_mask, kv)
            return self.norm(stream)
        embeds, stream = self._layer0_inputs(ids, aux_hidden, is_mask, aux_index, None)
        for i, layer in enumerate(self.layers):
            emb = embeds if i == 0 else None
            if i == last and out_index is not None:
                kv = self._checkpoint(layer.kv, stream, emb, cos, sin)
                stream = self._run_layer(
                    i, stream[out_index], None, cos[out_index], sin[out_index], out_mask, kv
                )
            else:
                stream = self._run_layer(i, stream, emb, cos, sin, attn_mask, None)
        return self.norm(stream)

    def _layer0_inputs(
        self,
        ids: torch.Tensor,
        aux: torch.Tensor,
        is_mask: torch.Tensor,
        aux_index: torch.Tensor | None,
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds [n, H], fc output [n, H]) of the elements `rows` (all if None)."""
        mask_row = self.mask_hidden.view(1, -1)  # [1, n_aux*H]
        if rows is not None:
            ids, is_mask = ids[rows], is_mask[rows]
            aux = aux[rows] if aux_index is None else aux[aux_index[rows]]  # fc on the wanted rows only
            aux_index = None
        if not torch.is_autocast_enabled(aux.device.type):  # under autocast the matmul casts by itself
            aux = aux.to(mask_row.dtype)  # after the gather: only the rows used (inside the checkpoints)
        if aux_index is None:
            stream = self.fc(torch.where(is_mask[:, None], mask_row.to(aux.dtype), aux))
        else:
            stream = torch.where(is_mask[:, None], self.fc(mask_row), self.fc(aux)[aux_index])  # fc on R rows
        return self.embed_tokens(ids), stream

    def _context_kv(
        self,
        ids: torch.Tensor,
        aux: torch.Tensor,
        is_mask: torch.Tensor,
        aux_index: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, Hkv, D] of layer 0 for all N elements, each `KV_CHUNK` rows checkpointed on their
        own: forward and the recomputation in backward hold one chunk's embeddings, fc output, norms and
        projections at a time, not those of the whole context (which is every depth-0 element left of a
        segment's end: the same size in a row's last segment as in a single pass)."""
        N = ids.shape[0]
        parts = [
            self._checkpoint(
                self._kv_rows, ids, aux, is_mask, aux_index, (cos, sin), (lo, min(N, lo + KV_CHUNK))
            )
            for lo in range(0, N, KV_CHUNK)
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    def _kv_rows(
        self,
        ids: torch.Tensor,
        aux: torch.Tensor,
        is_mask: torch.Tensor,
        aux_index: torch.Tensor | None,
        rot: tuple[torch.Tensor, torch.Tensor],
        span: tuple[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's keys and values [hi - lo, Hkv, D] of elements lo..hi-1 (`span`; `rot`: every element's RoPE
        cos and sin)."""
        (cos, sin), (lo, hi) = rot, span
        rows = torch.arange(lo, hi, device=ids.device)
        embeds, stream = self._layer0_inputs(ids, aux, is_mask, aux_index, rows)
        return self.layers[0].kv(stream, embeds, cos[lo:hi], sin[lo:hi])  # type: ignore[operator]

    def _checkpoint(self, fn: Any, *args: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _run_layer(
        self,
        i: int,
        stream: torch.Tensor,
        embeds: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttnMask,
        kv: Any,
    ) -> torch.Tensor:
        layer = self.layers[i]
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(layer, stream, embeds, cos, sin, mask, kv, use_reentrant=False)
        return layer(stream, embeds, cos, sin, mask, kv)

    def forward_layout(
        self,
        layout: CODLayout,
        tokens: torch.Tensor,
        aux_rows: torch.Tensor,
        attn_mask: AttnMask,
        out_index: torch.Tensor | None = None,
        out_mask: AttnMask | None = None,
    ) -> torch.Tensor:
        """Forward for a packed row: element inputs gathered from its rows (see `layout_inputs`)."""
        owned = None if out_index is None else Owned(out_index, out_mask)
        return self.forward(**layout_inputs(layout, tokens, aux_rows), attn_mask=attn_mask, owned=owned)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, Vd] draft logits (unchunked; the loss computes them in chunks itself)."""
        return self.lm_head(hidden)


def layout_inputs(layout: CODLayout, tokens: torch.Tensor, aux_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Keyword inputs of `PEagleDraft.forward` for a (sub-)layout of a packed row.

    fc runs only on the depth-0 rows of the layout: `aux_hidden` holds those rows and `aux_index` points
    each element at its row (depth >= 1 elements get `mask_hidden` instead).

    Args:
        layout: the elements; tokens: LongTensor[L] shifted tokens; aux_rows: [L, n_aux*H] aux states.
    """
    real = layout.depth == 0
    aux_index = torch.zeros_like(layout.target)
    aux_index[real] = torch.arange(int(real.sum()), device=aux_index.device)
    return {
        "input_ids": tokens[layout.target],
        "aux_hidden": aux_rows[layout.target[real]],
        "is_mask": ~real,
        "position": layout.position,
        "aux_index": aux_index,
    }
