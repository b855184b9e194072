"""cache.layout with fp8 hidden states: stored as packed uint8 rows, read back as bf16; unknown dtypes refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.core import fp8


def test_fp8_specs_and_decode(meta):
    m = CacheMeta.from_dict({**meta.to_dict(), "hidden_dtype": layout.FP8, "has_last_hidden": True})
    specs = layout.array_specs(m)
    assert specs["aux_hidden"] == ("uint8", (3, 8 + 4)) and specs["last_hidden"] == ("uint8", (12,))
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0))
    stored = layout.to_storage(x, layout.FP8)
    assert np.array_equal(stored, fp8.encode_rows(x).numpy())
    back = layout.from_storage(stored, layout.FP8)
    assert back.dtype == torch.bfloat16 and back.shape == (5, 3, 8)
    assert float((back.float() - x).norm() / x.norm()) < 0.05


def test_unknown_hidden_dtype_is_refused(meta):
    with pytest.raises(ValueError, match="unknown hidden dtype"):
        layout.array_specs(CacheMeta.from_dict({**meta.to_dict(), "hidden_dtype": "float4"}))
