"""cache.layout with lossy hidden states (fp8, nf4): stored as packed uint8 rows, read back as bf16; unknown
dtypes and hidden sizes nf4 cannot pack refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.core import fp8, nf4


@pytest.mark.parametrize(
    ("dtype", "codec", "width", "tolerance"),
    [(layout.FP8, fp8, 64 + 4, 0.05), (layout.NF4, nf4, 32 + 2 + 4 + 16, 0.12)],
)
def test_lossy_specs_and_decode(meta, dtype, codec, width, tolerance):
    m = CacheMeta.from_dict(
        {**meta.to_dict(), "hidden_size": 64, "hidden_dtype": dtype, "has_last_hidden": True}
    )
    specs = layout.array_specs(m)
    assert specs["aux_hidden"] == ("uint8", (3, width)) and specs["last_hidden"] == ("uint8", (width,))
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
    stored = layout.to_storage(x, dtype)
    assert stored.dtype == np.uint8 and np.array_equal(stored, codec.encode_rows(x).numpy())
    back = layout.from_storage(stored, dtype)
    assert back.dtype == torch.bfloat16 and back.shape == (5, 3, 64)
    assert float((back.float() - x).norm() / x.norm()) < tolerance


def test_unknown_hidden_dtype_and_unpackable_size_are_refused(meta):
    with pytest.raises(ValueError, match="unknown hidden dtype"):
        layout.array_specs(CacheMeta.from_dict({**meta.to_dict(), "hidden_dtype": "float4"}))
    with pytest.raises(ValueError, match="multiple of 32"):
        layout.array_specs(
            CacheMeta.from_dict({**meta.to_dict(), "hidden_size": 40, "hidden_dtype": layout.NF4})
        )
