"""core/quantized_weights.py on hand-packed words: the bit order, AWQ's column interleave, GPTQ's stored zeros and
row groups, compressed-tensors' offset, FP8 blocks. Against the upstream packers (vLLM's AWQ and GPTQ, the
compressed-tensors package's own compressor): tests/vllm/test_quantized_targets.py."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.core import quantized_weights as qw


def _word(*fields: int, bits: int = 4) -> int:
    """Fields (least significant first) packed into one int32's value."""
    value = sum(f << (bits * i) for i, f in enumerate(fields))
    return value - (1 << 32) if value >= 1 << 31 else value


def test_unpack_reads_fields_least_significant_first_along_either_dim():
    word = torch.tensor([[_word(0, 1, 2, 3, 4, 5, 6, 7)]], dtype=torch.int32)
    assert qw.unpack_int32(word, 4, dim=1).tolist() == [list(range(8))]
    assert qw.unpack_int32(word, 4, dim=0).flatten().tolist() == list(range(8))
    top = torch.tensor([[_word(0, 0, 0, 0, 0, 0, 0, 15)]], dtype=torch.int32)  # a negative int32
    assert qw.unpack_int32(top, 4, dim=1).tolist() == [[0] * 7 + [15]]
    assert qw.unpack_int32(torch.tensor([[_word(1, 2, 3, 255, bits=8)]]), 8, dim=1).tolist() == [
        [1, 2, 3, 255]
    ]


def test_awq_puts_each_field_in_its_interleaved_column():
    """One input row, 8 outputs, zero 0, scales 1..8: field i holds column AWQ_ORDER[i], so field 1's value lands in
    column 2 and field 4's in column 1."""
    qweight = torch.tensor([[_word(0, 5, 0, 0, 3, 0, 0, 0)]], dtype=torch.int32)  # [I = 1, O / 8]
    qzeros = torch.zeros(1, 1, dtype=torch.int32)
    scales = torch.arange(1.0, 9.0).unsqueeze(0)  # [1, O]
    w = qw.awq_weight(qweight, qzeros, scales)
    assert w.shape == (8, 1)
    assert w.flatten().tolist() == [0, 3 * 2, 5 * 3, 0, 0, 0, 0, 0]


def test_gptq_adds_one_to_stored_zeros_and_groups_rows_by_g_idx():
    """8 input rows packed down one word per output, zeros stored as 7 (8 in the original format), two groups of
    scales 1 and 10, rows assigned to groups out of order by g_idx."""
    qweight = torch.tensor([[_word(8, 9, 10, 7, 8, 9, 10, 7)]], dtype=torch.int32)  # [I / 8 = 1, O = 1]
    qzeros = torch.tensor([[_word(7)], [_word(7)]], dtype=torch.int32)  # [groups, O / 8]: field 0 is output 0
    scales = torch.tensor([[1.0], [10.0]])
    g_idx = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    w = qw.gptq_weight(qweight, qzeros, scales, g_idx, zero_offset=1, bits=4)
    assert w.tolist() == [[0, 10, 2, -10, 0, 10, 2, -10]]
    w2 = qw.gptq_weight(
        qweight, qzeros, scales, None, zero_offset=0, bits=4
    )  # "gptq_v2": zeros as stored, rows 0-3 | 4-7
    assert w2.tolist() == [[1, 2, 3, 0, 10, 20, 30, 0]]


def test_compressed_tensors_values_are_offset_by_half_the_range():
    """4 bits: stored field f is the value f - 8; an asymmetric zero point is stored the same way, packed down the
    output dim."""
    packed = torch.tensor([[_word(9, 8, 0, 15)]], dtype=torch.int32)  # [O = 1, I = 4 of 8 slots]
    scale = torch.tensor([[0.5]])
    assert qw.packed_weight(packed, scale, None, [1, 4], bits=4).tolist() == [[0.5, 0.0, -4.0, 3.5]]
    zero = torch.tensor([[_word(9)]], dtype=torch.int32)  # zero point 1 for output 0
    assert qw.packed_weight(packed, scale, zero, [1, 4], bits=4).tolist() == [[0.0, -0.5, -4.5, 3.0]]


def test_fp8_scales_blocks_rows_or_the_whole_tensor():
    t = torch.ones(4, 4).to(torch.float8_e4m3fn)
    assert qw.fp8_weight(t, torch.tensor([[2.0, 3.0]])).tolist() == [[2, 2, 3, 3]] * 4
    assert qw.fp8_weight(t, torch.tensor([[2.0, 3.0]]), block=[4, 3])[0].tolist() == [2, 2, 2, 3]
    assert qw.fp8_weight(t, torch.tensor([[1.0], [2.0], [3.0], [4.0]]))[:, 0].tolist() == [1, 2, 3, 4]
    assert qw.fp8_weight(t, torch.tensor([5.0])).unique().tolist() == [5]


def test_a_packing_of_other_widths_is_refused():
    """3-bit GPTQ does not pack whole values into words: a ValueError the model reader turns into "no layer"; nor
    does a width the config names that the shapes contradict."""
    qzeros3, scales = torch.zeros(1, 3, dtype=torch.int32), torch.ones(1, 32)
    with pytest.raises(ValueError, match="not a 2-, 4- or 8-bit packing"):
        qw.gptq_weight(torch.zeros(3, 32, dtype=torch.int32), qzeros3, scales, None, 1)
    with pytest.raises(ValueError, match="not a 2-, 4- or 8-bit packing"):
        qw.gptq_weight(
            torch.zeros(4, 32, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), scales, None, 1, 8
        )
