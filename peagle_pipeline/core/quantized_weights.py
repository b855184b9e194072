"""A quantised checkpoint's linear weight turned back into the dense [out, in] matrix a draft layer can start from.

Four stored forms, each read from its tensors alone (shapes give the bit width and the group size):

- FP8 (`fp8_weight`): float8 values times a scale per block (Qwen3-FP8 and DeepSeek: `weight_scale_inv`
  [ceil(O / b0), ceil(I / b1)]), per row or per tensor (compressed-tensors: `weight_scale` [O, 1] or [1]).
- AWQ, GEMM layout (`awq_weight`): `qweight` [I, O * bits / 32] int32, the columns of each word interleaved
  (`AWQ_ORDER`), `qzeros` [I / g, O * bits / 32] alike, `scales` [I / g, O].
- GPTQ (`gptq_weight`): `qweight` [I * bits / 32, O] packed down the input dim, `qzeros` [I / g, O * bits / 32]
  packed across, `scales` [I / g, O], `g_idx` [I] when the rows were quantised out of order (`desc_act`). The
  original format ("gptq") stores each zero point minus one; "gptq_v2" stores it as it is.
- compressed-tensors "pack-quantized" (`packed_weight`, llm-compressor's W4A16 and W8A16): `weight_packed`
  [O, ceil(I * bits / 32)] of values offset by 2 ** (bits - 1), `weight_scale` [O, I / g] (or [O, 1]),
  `weight_zero_point` [ceil(O * bits / 32), I / g] packed down the output dim when asymmetric, `weight_shape` [2].

In every integer form, weight = (q - zero) x scale with the group's zero and scale. The bit width is the config's
(`bits`) or, without one, the one whose packing fills the words exactly. Pure torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["AWQ_ORDER", "unpack_int32", "fp8_weight", "awq_weight", "gptq_weight", "packed_weight"]

# Where AWQ's GEMM kernels put column j of each group of 32 / bits columns inside one int32: field i of the word
# holds column AWQ_ORDER[bits][i]. E.g. 4 bits: fields 0..7 hold columns 0, 2, 4, 6, 1, 3, 5, 7.
AWQ_ORDER = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit fields of int32 words, least significant first, laid out along `dim`.

    [.., n, ..] int32 -> [.., n * 32 / bits, ..] int32. Example (bits 4, one word 0x76543210 along dim 1):
    [[0x76543210]] -> [[0, 1, 2, 3, 4, 5, 6, 7]].
    """
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    fields = (packed.unsqueeze(-1) >> shifts) & (
        (1 << bits) - 1
    )  # [..., per_word]; >> keeps the sign: masked
    dim = dim % packed.dim()
    fields = fields.movedim(-1, dim + 1)  # each word's fields right after it along `dim`
    return fields.flatten(dim, dim + 1)


def _bits(words: int, values: int, bits: int | None) -> int:
    """The bit width (2, 4 or 8) that packs `values` values into `words` int32 words: `bits` when the checkpoint's
    config names it, else the one that fills the words exactly (real layers' sizes are multiples of 32)."""
    bits = bits or (32 * words // values if values else 0)
    if bits not in (2, 4, 8) or words != -(-values * bits // 32):
        raise ValueError(f"{values} values in {words} int32 words is not a 2-, 4- or 8-bit packing")
    return bits


def _per_input(table: torch.Tensor, inputs: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """A [groups, O] table of zeros or scales expanded to [I, O]: row k of input k's group (g_idx[k], or k // g)."""
    if g_idx is None:
        g_idx = torch.arange(inputs) // -(-inputs // table.shape[0])
    return table[g_idx.long()]


def fp8_weight(t: torch.Tensor, scale: torch.Tensor, block: Sequence[int] | None = None) -> torch.Tensor:
    """An FP8 tensor [O, I] (or any shape for a per-tensor scale) times its scale, in bf16.

    A 2-D scale [ceil(O / b0), ceil(I / b1)] scales blocks of b0 x b1 (`block`: the checkpoint's weight_block_size;
    None derives it from the shapes, exact whenever b0 divides O and b1 divides I); [O, 1] or [O] scales rows, one
    value the whole tensor. Example: a [4, 4] weight with scale [[2.0, 3.0]] doubles columns 0-1, triples 2-3.
    """
    scale = scale.float()
    if scale.dim() == 2 and t.dim() == 2:
        derived = [-(-t.shape[0] // scale.shape[0]), -(-t.shape[1] // scale.shape[1])]
        rows, cols = block if block and scale.shape[1] > 1 else derived
        scale = scale.repeat_interleave(rows, 0)[: t.shape[0]].repeat_interleave(cols, 1)[:, : t.shape[1]]
    elif t.dim() > 1 and scale.numel() == t.shape[0]:
        scale = scale.reshape(-1, *[1] * (t.dim() - 1))
    else:
        scale = scale.reshape(())
    return (t.float() * scale).to(torch.bfloat16)


def awq_weight(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int | None = None
) -> torch.Tensor:
    """AWQ's GEMM layout (module docstring) -> [O, I] in the scales' dtype.

    Example (4 bits, one group): a word 0x00000010 in qweight row k holds field 1 = 1, which AWQ_ORDER puts in
    column 2: weight[2, k] = (1 - zero[2]) x scale[2].
    """
    inputs, outputs = qweight.shape[0], scales.shape[1]
    bits = _bits(qweight.shape[1], outputs, bits)
    order = torch.tensor(AWQ_ORDER[bits] if bits in AWQ_ORDER else range(32 // bits))
    unorder = torch.argsort(order)  # field position of each column within a word

    def columns(packed: torch.Tensor) -> torch.Tensor:
        fields = unpack_int32(packed, bits, dim=1)
        return fields.reshape(packed.shape[0], -1, order.numel())[:, :, unorder].flatten(1)[:, :outputs]

    q, zero = columns(qweight), columns(qzeros)  # [I, O], [I / g, O]
    w = (q - _per_input(zero, inputs, None)).float() * _per_input(scales.float(), inputs, None)
    return w.t().contiguous().to(scales.dtype)


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    zero_offset: int,
    bits: int | None = None,
) -> torch.Tensor:
    """GPTQ's layout (module docstring) -> [O, I] in the scales' dtype. `zero_offset`: 1 for the original
    format, whose zeros are stored minus one, 0 for "gptq_v2".

    Example (4 bits, symmetric, original format): zeros are stored as 7, so a stored 8 reads (8 - 8) x scale = 0.
    """
    outputs = scales.shape[1]
    bits = _bits(qzeros.shape[1], outputs, bits)
    q = unpack_int32(qweight, bits, dim=0)  # [I, O]
    inputs = q.shape[0]
    zero = unpack_int32(qzeros, bits, dim=1)[:, :outputs] + zero_offset  # [I / g, O]
    w = (q - _per_input(zero, inputs, g_idx)).float() * _per_input(scales.float(), inputs, g_idx)
    return w.t().contiguous().to(scales.dtype)


def packed_weight(
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    shape: Sequence[int],
    g_idx: torch.Tensor | None = None,
    bits: int | None = None,
) -> torch.Tensor:
    """compressed-tensors' pack-quantized form (module docstring) -> [O, I] in the scale's dtype.

    Example (4 bits, symmetric): a stored field 9 is the value 9 - 8 = 1, which reads 1 x scale.
    """
    outputs, inputs = int(shape[0]), int(shape[1])
    bits = _bits(weight_packed.shape[1], inputs, bits)
    offset = 1 << (bits - 1)
    q = unpack_int32(weight_packed, bits, dim=1)[:, :inputs] - offset  # [O, I]
    zero = torch.zeros_like(scale, dtype=torch.int32)
    if zero_point is not None:
        zero = unpack_int32(zero_point, bits, dim=0)[:outputs] - offset  # [O, I / g]
    zero, scale_full = (_per_input(table.t(), inputs, g_idx).t() for table in (zero, scale.float()))  # [O, I]
    return ((q - zero).float() * scale_full).to(scale.dtype)
