"""nf4 hidden-state storage (core/nf4.py): the worked example, the error bound, outliers kept, determinism, sizes,
refusals."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.core import nf4


def test_the_worked_example_of_the_docstring() -> None:
    x = torch.zeros(32)
    x[:6] = torch.tensor([8.0, -4.0, 2.0, 1.0, 0.5, -0.25])
    packed = nf4.encode_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (nf4.packed_width(32),) == (37,)
    assert packed[:16].tolist() == [0x77, 0x77, 0x2F] + [0x77] * 13  # codes: 0 -> 7; 0.5 -> 15; -0.25 -> 2
    y = nf4.decode_rows(packed, torch.float32)
    assert y[:4].tolist() == [8.0, -4.0, 2.0, 1.0]  # the outliers, exact
    # -0.25 / 0.5 = -0.5 rounds to level 2, NF4's -0.5251 as bf16 holds it (-0.5234), times the block scale 0.5
    assert abs(float(nf4.LEVELS[2]) + 0.5251) < 0.002 and packed[16] == 126  # e4m3 code of 448: scale / row
    assert y[4] == 0.5 and y[5] == float(nf4.LEVELS[2]) * 0.5 == -0.26171875 and bool((y[6:] == 0).all())
    assert torch.equal(nf4.decode_rows(nf4.encode_rows(torch.zeros(3, 64))), torch.zeros(3, 64).bfloat16())


def _activations(tokens: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 3, 576, generator=g) * torch.logspace(-1, 1, 576)  # [T, n_aux, H]
    x[:, :, 7] *= 80.0  # outlier channels, as LLM activations have
    x[:, :, 300] *= -40.0
    return x


def test_error_bound_and_outliers_kept() -> None:
    """Every value is off by at most half the widest NF4 level gap times its block's scale, plus the e4m3 rounding
    of that scale (2**-4 of it); each row's 4 largest values come back as bf16 rounds them."""
    x = _activations()
    y = nf4.decode_rows(nf4.encode_rows(x), torch.float32)
    top = x.abs().topk(nf4.OUTLIERS, dim=-1).indices
    assert torch.equal(torch.gather(y, -1, top), torch.gather(x, -1, top).bfloat16().float())
    rest = x.scatter(-1, top, 0.0).reshape(*x.shape[:-1], -1, nf4.BLOCK)
    amax = rest.abs().amax(-1, keepdim=True)
    gap = float((nf4.LEVELS[1:] - nf4.LEVELS[:-1]).max()) / 2
    err = (y.scatter(-1, top, 0.0).reshape(rest.shape) - rest).abs()
    assert bool((err <= (gap + 2**-4) * amax * 1.01 + 1e-6).all())
    assert float((y - x).norm() / x.norm()) < 0.08  # relative L2 error: ~7 %
    others = x.scatter(-1, top, 0.0)
    # outside the outliers: ~9 %
    assert float((y.scatter(-1, top, 0.0) - others).norm() / others.norm()) < 0.10


def test_rows_are_encoded_alone_and_deterministically() -> None:
    """A row's bytes depend on that row only (a resumed extraction re-batches the same rows into the same bytes)."""
    x = _activations(16).bfloat16()
    packed = nf4.encode_rows(x)
    assert torch.equal(packed, nf4.encode_rows(x.clone()))
    assert torch.equal(packed[5:9], nf4.encode_rows(x[5:9])) and torch.equal(
        packed[3, 1], nf4.encode_rows(x[3, 1])
    )
    y = nf4.decode_rows(packed)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # a slice (unaligned start) decodes alike
    assert torch.equal(nf4.decode_rows(packed[2:3, 1:]), y[2:3, 1:])


def test_sizes() -> None:
    assert nf4.packed_width(576) == 288 + 18 + 4 + 16 and nf4.hidden_width(326) == 576
    assert nf4.packed_width(576) / (2 * 576) < 0.29 and nf4.packed_width(4096) / (2 * 4096) < 0.272
    assert all(nf4.hidden_width(nf4.packed_width(h)) == h for h in (32, 64, 2880, 4096, 8192))


def test_refusals() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        nf4.packed_width(100)
    with pytest.raises(ValueError, match="multiple of 32"):
        nf4.encode_rows(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="uint8"):
        nf4.decode_rows(torch.zeros(2, 37, dtype=torch.int16))
    with pytest.raises(ValueError, match="not the width of an nf4 row"):
        nf4.decode_rows(torch.zeros(2, 40, dtype=torch.uint8))
