"""4-bit (NF4) storage of hidden states: the smallest opt-in lossy cache (`--dtype nf4`), read back as bf16.

A row is one token's vector of one layer (H values, H a multiple of 32). Its 4 largest-magnitude values (the
outlier channels LLM activations are known for) are kept apart in bf16 with their channel index; the other values
(the outliers' places set to 0) are split into blocks of BLOCK = 32 consecutive channels, each stored as 4-bit
codes into the 16 NF4 levels (normal-distribution quantiles on [-1, 1]) times the block's scale (its largest
magnitude). Block scales are fp8-e4m3 codes under one fp32 scale per row (the largest block scale / 448).

Packed row, uint8, width `packed_width(H)` = H/2 + H/32 + 4 + 4*OUTLIERS (326 bytes for H = 576; bf16 takes
1,152, so 0.283x; 0.27x for H >= 4096):

    [0, H/2)              codes: byte j holds value 2j in its low nibble and value 2j+1 in its high nibble
    [H/2, +H/32)          the blocks' e4m3 scale codes
    [.., +4)              the row's fp32 scale (little-endian)
    [.., +2*OUTLIERS)     the outliers' channel indices, uint16, ascending
    [.., +2*OUTLIERS)     the outliers' values, bf16 bits

Why these choices (experiments/quant4_formats.py on SmolLM2-135M's aux layers, docs/reference/cache-format.md):
NF4 beats int4 (absmax) by about a third in relative L2 error and matches e2m1 (fp4) at equal size; blocks of 32
with e4m3 scales cost 0.27 bit a value; without the 4 outliers kept apart, a block holding an outlier channel
quantises its 31 neighbours to zero or near it, and the error outside the outlier channels doubles (0.19 against
0.10 relative L2). Encoding is deterministic (same input, same bytes), so a resumed extraction rewrites shards
byte for byte. Pure: torch only, no I/O.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "OUTLIERS", "LEVELS", "packed_width", "hidden_width", "encode_rows", "decode_rows"]

BLOCK = 32  # values per block scale
OUTLIERS = 4  # values per row kept in bf16
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# The NF4 levels (QLoRA's 4-bit NormalFloat: quantiles of N(0, 1) scaled to [-1, 1], with an exact 0).
LEVELS = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0]
)  # fmt: skip
LEVELS = LEVELS.to(torch.bfloat16).float()  # exactly representable in bf16, as decoding produces them
_MIDPOINTS = (LEVELS[1:] + LEVELS[:-1]) / 2  # a value rounds to the level whose interval holds it
# Rounding by lookup: a value v in [-1, 1] falls in bin floor((v + 1) * GRID / 2) of GRID equal bins, each mapped
# to the level nearest its centre (4x faster than a search over the midpoints on CPU). Only values within 1/GRID
# of a midpoint can round to its other side: a difference of at most one level step, and deterministic.
GRID = 8192
_ROUND = torch.bucketize((torch.arange(GRID) + 0.5) * (2 / GRID) - 1, _MIDPOINTS).to(torch.int32)
# code byte -> its two bf16 levels (low nibble first) as one int32 word: decoding is one lookup per 2 values
# into a 1 KiB table (index_select: several times faster on CPU than advanced indexing or take)
_PAIRS = (
    torch.stack([LEVELS.repeat(16), LEVELS.repeat_interleave(16)], dim=-1)
    .to(torch.bfloat16)
    .view(torch.int32)
    .reshape(256)
)


def packed_width(hidden_size: int) -> int:
    """Bytes per stored row of `hidden_size` values (see the module docstring).

    Raises:
        ValueError: `hidden_size` not a multiple of BLOCK.
    """
    if hidden_size <= 0 or hidden_size % BLOCK:
        raise ValueError(f"nf4 storage needs a hidden size that is a multiple of {BLOCK}, got {hidden_size}")
    return hidden_size // 2 + hidden_size // BLOCK + 4 + 4 * OUTLIERS


def hidden_width(packed: int) -> int:
    """The hidden size whose rows pack into `packed` bytes (the inverse of `packed_width`); ValueError if none."""
    H = (packed - 4 - 4 * OUTLIERS) * 2 * BLOCK // (BLOCK + 2)
    if H <= 0 or H % BLOCK or packed_width(H) != packed:
        raise ValueError(f"{packed} bytes is not the width of an nf4 row")
    return H


def encode_rows(x: torch.Tensor) -> torch.Tensor:
    """Hidden states [..., H] (any float dtype, H a multiple of 32) -> packed uint8 [..., packed_width(H)].

    Example (H = 32, one row): x = [8, -4, 2, 1, 0.5, -0.25, 0, ..., 0]. The 4 outliers 8, -4, 2, 1 are kept
    apart (indices 0..3, values in bf16: exact) and zeroed in the blocks. The one block's maximum is then 0.5: its
    scale 0.5 is stored as e4m3 code 448 (byte 126) under the row scale 0.5 / 448. Codes: 0.5 / 0.5 = 1 -> level
    1.0 (code 15); -0.25 / 0.5 = -0.5 -> level -0.5251 (code 2); zeros -> level 0 (code 7): the code bytes are
    0x77, 0x77, 0x2F, then 0x77. Decoding gives [8, -4, 2, 1, 0.5, -0.2617, 0, ...] (-0.5251 as bf16 holds it,
    -0.5234, times 0.5).
    A row of zeros stores row scale 1 and decodes to zeros.
    """
    *lead, H = x.shape
    width = packed_width(H)
    x = x.float().reshape(-1, H)  # [R, H]
    idx = x.abs().topk(OUTLIERS, dim=-1).indices.sort(dim=-1).values  # [R, OUTLIERS], ascending
    kept = torch.gather(x, -1, idx).to(torch.bfloat16)  # [R, OUTLIERS]
    rest = x.scatter(-1, idx, 0.0).reshape(-1, H // BLOCK, BLOCK)  # [R, nb, BLOCK]
    amax = rest.abs().amax(-1)  # [R, nb]
    row = amax.amax(-1, keepdim=True) / FP8_MAX  # [R, 1]
    row = torch.where(row > 0, row, torch.ones_like(row))
    codes = (amax / row).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)  # [R, nb]
    scale = codes.float() * row  # the scale decoding will use
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)  # [R, nb, 1]
    q = _round(rest / safe).reshape(-1, H)  # [R, H] codes 0..15
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # [R, H/2]
    parts = [
        nibbles,
        codes.view(torch.uint8),
        row.contiguous().view(torch.uint8),
        idx.to(torch.int16).view(torch.uint8),  # indices < 2**15 for every hidden size in use
        kept.view(torch.uint8),
    ]
    return torch.cat(parts, dim=-1).reshape(*lead, width)


def decode_rows(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Packed uint8 [..., packed_width(H)] -> hidden states [..., H] in `dtype` (bf16 by default).

    Raises:
        ValueError: not uint8, or a width no hidden size packs into.
    """
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise ValueError(
            f"nf4 rows must be uint8 [..., packed width], got {packed.dtype} {tuple(packed.shape)}"
        )
    *lead, width = packed.shape
    H = hidden_width(width)
    nb = H // BLOCK
    p = packed.reshape(-1, width)  # [R, width]
    a, b, c, d = H // 2, H // 2 + nb, H // 2 + nb + 4, H // 2 + nb + 4 + 2 * OUTLIERS
    # [R * H/2] int32 words, two bf16 levels each
    pairs = torch.index_select(_PAIRS.to(p.device), 0, p[:, :a].reshape(-1).int())
    values = pairs.view(torch.bfloat16).reshape(-1, nb, BLOCK)  # [R, nb, BLOCK] in [-1, 1]
    codes = _copy(p[:, a:b]).view(torch.float8_e4m3fn).float()  # [R, nb]
    row = _copy(p[:, b:c]).view(torch.float32)  # [R, 1]
    idx = _copy(p[:, c:d]).view(torch.int16).long()  # [R, OUTLIERS]
    kept = _copy(p[:, d:]).view(torch.int16)  # [R, OUTLIERS] bf16 bits
    out = (values * (codes * row).to(torch.bfloat16).unsqueeze(-1)).reshape(-1, H)  # [R, H] bf16
    out.view(torch.int16).scatter_(-1, idx, kept)  # (bf16's own scatter is 200x slower on CPU)
    return out.to(dtype).reshape(*lead, H)


def _round(v: torch.Tensor) -> torch.Tensor:
    """Values (any shape, float) -> the uint8 codes of their nearest NF4 levels (by lookup, see GRID)."""
    bins = ((v.clamp(-1.0, 1.0) + 1.0) * (GRID / 2)).to(torch.int32).clamp_(max=GRID - 1)
    table = _ROUND.to(v.device)
    return torch.index_select(table, 0, bins.reshape(-1)).to(torch.uint8).reshape(v.shape)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy: viewing bytes as a wider type needs an aligned start, which a slice may not have."""
    return t.clone(memory_format=torch.contiguous_format)
