"""The KV store of the HF decode loop: `slots` rows of `capacity` positions per layer, written in place.

Row b of the store holds one request's keys and values from column 0: its prompt, then one column per decoded
token, so a decode step writes column `lens[b]` of every row and attends to the columns `0 .. window-1`
(a prefix, masked per row). The store is handed to a transformers model as `past_key_values`; the model calls
only `update(key_states, value_states, layer_idx)` on it, because the loop always passes position ids and a 4D
attention mask (transformers then builds no mask and asks the cache nothing else). The loop says what the next
forward is with `prefill(...)` or `decode(...)` before it.
"""

from __future__ import annotations

import torch

__all__ = ["SlotCache", "decode_attention"]


class SlotCache:
    """Preallocated keys/values, [slots, kv_heads, capacity, head_dim] per layer (allocated at the first write)."""

    is_compileable = False

    def __init__(self, slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._mode = ""
        self._rows: torch.Tensor | None = None  # prefill: [n] slots; decode: [B] row indices
        self._cols: torch.Tensor | None = None  # prefill: [n, P] source columns; decode: [B] target columns
        self._batch = self._window = 0
        self._arange = torch.arange(0)

    def prefill(self, slots: torch.Tensor, offsets: torch.Tensor, width: int) -> None:
        """The next forward is a left-padded prefill of `width` columns for `slots` ([n]); row j's prompt starts
        at column offsets[j] ([n]) and is stored from column 0."""
        cols = torch.arange(width, device=offsets.device)[None, :] + offsets[:, None]  # [n, width]
        self._mode, self._rows, self._cols = "prefill", slots, cols.clamp_(max=width - 1)

    def decode(self, batch: int, cols: torch.Tensor, window: int) -> None:
        """The next forward is one token for rows 0..batch-1, written at column cols[b] ([batch]); attention
        sees columns 0..window-1 of those rows."""
        self._mode, self._batch, self._window = "decode", batch, window
        if self._arange.numel() != batch or self._arange.device != cols.device:
            self._arange = torch.arange(batch, device=cols.device)  # kept: a CUDA graph replays its address
        self._rows, self._cols = self._arange, cols

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's keys/values ([n, kv_heads, q, head_dim]) and return what attention reads."""
        if layer_idx == len(self.keys):
            shape = (self.slots, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys.append(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))
            self.values.append(torch.zeros(shape, dtype=value_states.dtype, device=value_states.device))
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "prefill":
            n, h, width, d = key_states.shape
            idx = self._cols[:, None, :, None].expand(n, h, width, d)  # type: ignore[index]
            k[self._rows, :, :width] = key_states.gather(2, idx)  # left-aligned: column c = prompt token c
            v[self._rows, :, :width] = value_states.gather(2, idx)
            return key_states, value_states
        k[self._rows, :, self._cols] = key_states[:, :, 0]
        v[self._rows, :, self._cols] = value_states[:, :, 0]
        return k[: self._batch, :, : self._window], v[: self._batch, :, : self._window]

    def compact(self, keep: torch.Tensor) -> None:
        """Move rows `keep` ([m], ascending) to rows 0..m-1."""
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[: keep.numel()] = t[keep]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except one-token steps of grouped-query attention with a [B, 1, 1, L] mask:
    those put each KV head's query heads on the query axis instead of repeating the keys and values per head
    (the repeat would copy the whole window of every layer at every step).

    Args:
        query: [B, Hq, q, D]; key, value: [B, Hkv, L, D]. Returns [B, q, Hq, D] as transformers' functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, q, D = query.shape
    Hkv = key.shape[1]
    plain = (
        q != 1
        or Hkv == Hq
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1:3] != (1, 1)
        or kwargs.get("dropout", 0.0)
        or any(kwargs.get(k) is not None for k in ("sliding_window", "s_aux", "softcap", "position_bias"))
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[arg-type]
    grouped = query.reshape(
        B, Hkv, Hq // Hkv, D
    )  # query head h uses KV head h // (Hq / Hkv), as repeat_kv does
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped,
        key,
        value,
        attn_mask=attention_mask[:, :, :, : key.shape[2]],  # type: ignore[index]  # checked above
        scale=kwargs.get("scaling"),  # type: ignore[arg-type]
    )  # [B, Hkv, G, D]
    return out.reshape(B, 1, Hq, D), None
