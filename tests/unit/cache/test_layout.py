"""cache.layout: bf16 <-> uint16 storage is bit-exact and zero-copy; array specs; checksums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta


def test_bf16_round_trip_bit_exact_including_specials():
    x = torch.randn(257, 3, 16).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    stored = layout.to_storage(x, "bfloat16")
    assert stored.dtype == np.uint16
    back = layout.from_storage(stored, "bfloat16")
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.uint16), x.view(torch.uint16))  # bits, so NaN compares equal


def test_from_storage_is_a_view():
    bits = np.arange(12, dtype=np.uint16).reshape(3, 4)
    t = layout.from_storage(bits, "bfloat16")
    bits[0, 0] = 0x3F80  # 1.0 in bf16
    assert t[0, 0].item() == 1.0


def test_to_storage_rounds_float_to_bf16_bits_or_keeps_fp32():
    x = torch.randn(5, 7, dtype=torch.float32)
    assert np.array_equal(layout.to_storage(x, "bfloat16"), x.to(torch.bfloat16).view(torch.uint16).numpy())
    kept = layout.to_storage(x, "float32")
    assert kept.dtype == np.float32 and np.array_equal(kept, x.numpy())
    with pytest.raises(ValueError, match="unknown logical dtype"):
        layout.to_storage(x, "float16")


def test_array_specs(meta):
    specs = layout.array_specs(meta)
    assert specs["aux_hidden"] == ("uint16", (3, 8))
    assert specs["topk_logprobs"] == ("float16", (4,))
    assert "last_hidden" not in specs
    fp32 = CacheMeta.from_dict({**meta.to_dict(), "hidden_dtype": "float32", "has_last_hidden": True})
    assert layout.array_specs(fp32)["last_hidden"] == ("float32", (8,))


def test_meta_differences(meta):
    other = CacheMeta.from_dict({**meta.to_dict(), "topk": 8, "aux_layer_ids": [1, 2, 3], "extra": {"x": 1}})
    assert other.differences(meta) == ["aux_layer_ids", "topk"]


def test_a_cache_from_before_length_sorting_reads_as_row_order(meta):
    old = meta.to_dict()
    del old["length_window"]  # cache.json written before the field existed: samples stored in row order
    assert CacheMeta.from_dict(old).length_window == 1
    assert CacheMeta.from_dict(old).differences(meta) == [
        "length_window"
    ]  # a resume at 256 is refused by name


def test_chat_template_kwargs_are_part_of_the_cache_settings(meta):
    """Rows rendered with other template variables are other rows: a resume with other kwargs is refused by name;
    a cache.json from before the field existed was rendered without any and resumes without any."""
    old = meta.to_dict()
    del old["chat_template_kwargs"]
    assert CacheMeta.from_dict(old).chat_template_kwargs == {} and not CacheMeta.from_dict(old).differences(
        meta
    )
    other = CacheMeta.from_dict({**meta.to_dict(), "chat_template_kwargs": {"enable_thinking": False}})
    assert other.differences(meta) == ["chat_template_kwargs"]


def test_checksum_sensitive_to_one_bit():
    a = np.zeros((10, 4), dtype=np.uint16)
    b = a.copy()
    b[9, 3] = 1
    assert layout.checksum(a) != layout.checksum(b)
    assert layout.checksum(a) == layout.checksum(a.copy())
