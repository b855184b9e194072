"""runtime helpers used by generate: compute dtype choice, bf16 detection, exclusive create."""

from __future__ import annotations

import pytest

from peagle_pipeline.runtime import cpu_has_bf16, create_exclusive, resolve_compute_dtype


def test_compute_dtype():
    assert resolve_compute_dtype("auto", "cuda") == "bf16"
    assert resolve_compute_dtype("auto", "cuda:1") == "bf16"
    assert resolve_compute_dtype("fp32", "cuda") == "fp32" and resolve_compute_dtype("bf16", "cpu") == "bf16"
    assert resolve_compute_dtype("auto", "cpu") == ("bf16" if cpu_has_bf16() else "fp32")
    with pytest.raises(ValueError):
        resolve_compute_dtype("fp16", "cpu")


def test_cpu_bf16_flags():
    assert cpu_has_bf16("flags : fpu sse avx512f avx512_bf16 amx_tile")
    assert cpu_has_bf16("flags : fpu amx_bf16")
    assert not cpu_has_bf16("flags : fpu sse avx2 avx512f")


def test_create_exclusive(tmp_path):
    path = tmp_path / "meta.json"
    assert create_exclusive(path, "first\n") and not create_exclusive(path, "second\n")
    assert path.read_text() == "first\n" and [p.name for p in tmp_path.iterdir()] == ["meta.json"]
