"""HF and vLLM backends on SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) agree within bf16 tolerance.

"bf16 tolerance" is measured, not assumed: the same samples through HF in fp32 give the rounding noise of bf16
itself (HF bf16 vs HF fp32); vLLM bf16 vs HF bf16 must stay within that noise (plus a small margin).
"""

from __future__ import annotations

import pytest
from agreement import compare, render_samples
from conftest import SHAREGPT, SMOLLM2

pytestmark = [
    pytest.mark.real,
    pytest.mark.slow,
    pytest.mark.skipif(
        not SMOLLM2.is_dir() or not SHAREGPT.is_file(),
        reason="SmolLM2 demo assets missing: run `make demo-assets`",
    ),
]


def _cfg(dtype: str):  # type: ignore[no-untyped-def]
    from peagle_pipeline.config import ExtractConfig

    return ExtractConfig(
        model=str(SMOLLM2),
        data=[str(SHAREGPT)],
        output="unused",
        topk=32,
        last_hidden=True,
        max_length=256,
        device="cpu",
        dtype=dtype,
    )


def test_smollm2_hf_and_vllm_agree_within_bf16_noise() -> None:
    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.backends.vllm import VLLMBackend
    from peagle_pipeline.stages.extract.settings import backend_settings
    from peagle_pipeline.target_info import default_layer_ids

    layers = default_layer_ids(30)
    samples = render_samples(str(SMOLLM2), str(SHAREGPT), 6, 256)
    assert len(samples) == 6
    outs = {}
    for dtype in ("fp32", "bf16"):
        hf = HFBackend(backend_settings(_cfg(dtype)), layers)
        outs[dtype] = hf.forward(samples)
        hf.close()
    vb = VLLMBackend(backend_settings(_cfg("bf16")), layers)
    try:
        got = vb.forward(samples)
    finally:
        vb.close()
    for r, g in zip(outs["bf16"], got, strict=True):
        assert g.aux_hidden.shape == r.aux_hidden.shape and g.aux_hidden.dtype == r.aux_hidden.dtype
        assert g.topk_ids.shape == r.topk_ids.shape
    noise = compare(outs["fp32"], outs["bf16"])  # bf16 rounding alone
    vllm = compare(outs["bf16"], got)
    print(f"\nHF bf16 vs HF fp32: {noise}\nvLLM bf16 vs HF bf16: {vllm}")
    assert vllm["aux_rel"] < 2 * noise["aux_rel"] + 1e-3
    assert vllm["last_rel"] < 2 * noise["last_rel"] + 1e-3
    assert vllm["topk_overlap"] >= min(0.98, noise["topk_overlap"] - 0.015)
    assert vllm["top1_agree"] >= min(0.98, noise["top1_agree"] - 0.015)
    assert vllm["top1_logprob_max_abs"] < 1.0  # near-ties: a flipped argmax row can differ by ~0.5
