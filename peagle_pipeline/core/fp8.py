"""fp8 (e4m3) storage of hidden states with one fp32 scale per row: the opt-in lossy cache (`--dtype fp8`).

A row is one token's vector of one layer (H values). It is stored as H + 4 bytes: the H values divided by the
row's scale (amax / 448, the largest e4m3 value) as float8_e4m3fn bits, then the scale's float32 bytes
(little-endian, as every machine this runs on). Why a scale per row and not per block of channels: e4m3 is a
floating-point format, so within one row every value down to 2**-15 of the row's largest keeps its 3 mantissa bits
(relative error <= 2**-4, about 2.2 % on average); the massive-activation channels of LLMs therefore cost
nothing to their neighbours, while a scale per 128-value block would add 3 % of bytes for no measurable gain
(bench/bench_fp8.py reports the error). Pure: torch only, no I/O.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "SCALE_BYTES", "encode_rows", "decode_rows", "packed_width"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
SCALE_BYTES = 4


def packed_width(hidden_size: int) -> int:
    """Bytes per stored row of `hidden_size` values: the fp8 values, then the fp32 scale."""
    return hidden_size + SCALE_BYTES


def encode_rows(x: torch.Tensor) -> torch.Tensor:
    """Hidden states [..., H] (any float dtype) -> packed uint8 [..., H + 4] (see the module docstring).

    Example: a row [0.5, -2.0, 8.0] has amax 8, scale 8/448 = 0.0179; it stores fp8(28.0), fp8(-112.0),
    fp8(448.0) and the scale's 4 bytes; decoding gives [0.5, -2.0, 8.0] exactly (all three fit e4m3).
    A row of zeros stores scale 1.
    """
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [..., 1]
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [..., H]
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)  # [..., H + 4]


def decode_rows(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Packed uint8 [..., H + 4] -> hidden states [..., H] in `dtype` (bf16 by default, as the lossless cache)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] <= SCALE_BYTES:
        raise ValueError(
            f"fp8 rows must be uint8 [..., H + {SCALE_BYTES}], got {packed.dtype} {tuple(packed.shape)}"
        )
    q = packed[..., :-SCALE_BYTES].contiguous().view(torch.float8_e4m3fn).float()  # [..., H]
    # a fresh copy: viewing bytes as float32 needs a 4-byte aligned start, which a slice may not have
    scale = (
        packed[..., -SCALE_BYTES:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    )  # [..., 1]
    return (q * scale).to(dtype)
