"""cache.estimate: bytes per token of each array from the format's own specs, the fixed part, the target pieces."""

from __future__ import annotations

import pytest

from peagle_pipeline.cache import estimate as sizes
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.estimate import CacheShape

SMOLLM2 = dict(hidden_size=576, n_aux=3, topk=32, vocab_size=49152)


def test_hidden_states_are_sized_from_the_stored_rows() -> None:
    trailer = (sizes.CRC_BYTES + sizes.INDEX_ENTRY_BYTES) / 128
    bf16 = sizes.bytes_per_token(CacheShape(hidden_dtype="bfloat16", **SMOLLM2))
    fp8 = sizes.bytes_per_token(CacheShape(hidden_dtype=layout.FP8, **SMOLLM2))
    nf4 = sizes.bytes_per_token(CacheShape(hidden_dtype=layout.NF4, **SMOLLM2))
    assert bf16["aux_hidden"] == pytest.approx(3 * 576 * 2 + trailer)
    assert fp8["aux_hidden"] == pytest.approx(3 * 580 + trailer)
    assert nf4["aux_hidden"] == pytest.approx(3 * 326 + trailer)
    assert nf4["aux_hidden"] / bf16["aux_hidden"] < 0.30
    # the rest does not depend on the hidden dtype: ~110 bytes for top-32 on SmolLM2's measured compression
    rest = {k: v for k, v in bf16.items() if k != "aux_hidden"}
    assert rest == {k: v for k, v in nf4.items() if k != "aux_hidden"} and 100 < sum(rest.values()) < 120
    assert sum(bf16.values()) == pytest.approx(3566, abs=1)  # the module docstring's example


def test_compress_settings_and_the_last_hidden_state() -> None:
    raw = sizes.bytes_per_token(
        CacheShape(hidden_dtype="bfloat16", compress="none", has_last_hidden=True, **SMOLLM2)
    )
    assert raw["topk_ids"] == pytest.approx(32 * 4 + 16 / 128) and raw["last_hidden"] == pytest.approx(
        1152 + 0.125
    )
    zstd = sizes.bytes_per_token(CacheShape(hidden_dtype="bfloat16", compress="zstd", **SMOLLM2))
    assert zstd["aux_hidden"] < 0.85 * raw["aux_hidden"]


def test_fixed_bytes_and_pieces() -> None:
    shape = CacheShape(hidden_dtype="bfloat16", **SMOLLM2)
    half_chunk = sum(sizes.bytes_per_token(shape).values()) * 128 / 2
    assert sizes.fixed_bytes(shape, 2, 10) == pytest.approx(2 * (16 * 49152 + 8000 + half_chunk) + 10 * 48)
    llama8b = {"hidden_size": 4096, "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 14336, "torch_dtype": "bfloat16"}  # fmt: skip
    # embedding + lm_head (1.05 GB each) + norm + one decoder layer: q, o 4096^2; k, v 4096 x 1024; MLP 3 x 4096 x 14336
    assert sizes.pieces_bytes(llama8b) == 2 * (
        2 * 128256 * 4096 + 4096 + 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 8192
    )
    assert sizes.pieces_bytes(llama8b, init_layer=False) == 2 * (2 * 128256 * 4096 + 4096)
    assert sizes.pieces_bytes({**llama8b, "torch_dtype": "float32"}, init_layer=False) == 4 * (
        2 * 128256 * 4096 + 4096
    )
