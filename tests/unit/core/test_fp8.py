"""fp8 hidden-state storage (core/fp8.py): exact cases, the error bound, packing, refusals."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.core import fp8


def test_values_that_fit_e4m3_round_trip_exactly_and_zeros_stay_zero() -> None:
    x = torch.tensor([[0.5, -2.0, 8.0], [0.0, 0.0, 0.0]])
    packed = fp8.encode_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (2, fp8.packed_width(3)) == (2, 7)
    assert torch.equal(fp8.decode_rows(packed, torch.float32), x)
    assert packed[1, -4:].clone().view(torch.float32).item() == 1.0
    assert torch.equal(
        fp8.decode_rows(packed[1]), x[1].bfloat16()
    )  # one row, its scale at an odd offset  # the zero row's scale


def test_round_trip_error_bound_on_activation_like_rows() -> None:
    """|x' - x| <= 2**-4 |x| (3 mantissa bits, round to nearest) + 2**-10 * scale (half the smallest subnormal
    step) for every value, with channels spanning 4 decades and a few massive-activation outliers."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 576, generator=g) * torch.logspace(-2, 2, 576)  # [T, n_aux, H]
    x[:, :, 7] *= 50.0  # an outlier channel, as LLMs have
    y = fp8.decode_rows(fp8.encode_rows(x), torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / fp8.FP8_MAX
    assert bool(((y - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale).all())
    assert float((y - x).norm() / x.norm()) < 0.03  # relative L2 error: ~2-3 %
    assert torch.allclose(y.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # row maxima: fp32 exact


def test_bf16_input_and_bf16_output() -> None:
    x = (torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    y = fp8.decode_rows(fp8.encode_rows(x))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert float((y.float() - x.float()).norm() / x.float().norm()) < 0.05


def test_decode_refuses_what_is_not_packed_fp8() -> None:
    with pytest.raises(ValueError, match="uint8"):
        fp8.decode_rows(torch.zeros(2, 8, dtype=torch.uint16))
    with pytest.raises(ValueError, match="H \\+ 4"):
        fp8.decode_rows(torch.zeros(2, 4, dtype=torch.uint8))
