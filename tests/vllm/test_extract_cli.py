"""Full caches written by `peagle-pipeline extract --backend hf` and `--backend vllm` agree (fp32, tiny Llama).

The caches come from the real CLI in subprocesses (conftest `tiny_caches`) and are compared through the reader API.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import TINY_LAYERS, run_cli


def test_hf_and_vllm_caches_agree(tiny_caches: dict[str, Path]) -> None:
    from peagle_pipeline.cache.reader import open_cache

    hf, vl = open_cache(tiny_caches["hf"]), open_cache(tiny_caches["vllm"])
    assert hf.meta.aux_layer_ids == vl.meta.aux_layer_ids == TINY_LAYERS
    cols = ["sample_id", "source_row", "length", "num_supervised"]
    assert hf.samples[cols].equals(vl.samples[cols]) and len(hf.samples) == 12
    assert np.array_equal(hf.token_counts(), vl.token_counts())
    for sample_id in hf.samples["sample_id"].tolist():
        a, b = hf.read_sample(sample_id), vl.read_sample(sample_id)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(b.aux_hidden.float(), a.aux_hidden.float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.last_hidden.float(), a.last_hidden.float(), atol=1e-4, rtol=1e-4)
        assert torch.equal(a.topk_ids, b.topk_ids), f"sample {sample_id}: top-k ids differ"
        torch.testing.assert_close(b.topk_logprobs, a.topk_logprobs, atol=2e-3, rtol=1e-3)  # float16 storage


def test_a_gpt_oss_target_extracts_to_its_last_position(
    tiny_gpt_oss: Path, tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    """gpt-oss (mixture of experts, YaRN) through vLLM, at a max_length equal to the target's 256 positions: vLLM
    scores each sample with one token sampled after it, so samples keep 255 tokens (it refused the whole run
    before), and the cache equals the HF backend's at 255."""
    from tiny import write_conversations

    from peagle_pipeline.cache.reader import open_cache

    data = write_conversations(tmp_path / "conv.jsonl", 24)
    flags = [
        "--topk",
        "8",
        "--layers",
        "0,1,2",
        "--batch-tokens",
        "1024",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
    ]
    outputs = {}
    for backend, length in (("vllm", 256), ("hf", 255)):
        out = tmp_path / backend
        proc = run_cli(
            vllm_env, "extract", "--model", str(tiny_gpt_oss), "--data", str(data), "--output", str(out),
            "--backend", backend, "--max-length", str(length), *flags,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[backend] = proc.stdout + proc.stderr
    assert "samples keep at most 255 tokens, not max_length 256" in outputs["vllm"]
    hf, vl = open_cache(tmp_path / "hf"), open_cache(tmp_path / "vllm")
    assert int(vl.samples["length"].max()) == 255 and hf.samples["length"].equals(vl.samples["length"])
    for sample_id in hf.samples["sample_id"].tolist():
        a, b = hf.read_sample(sample_id), vl.read_sample(sample_id)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(b.aux_hidden.float(), a.aux_hidden.float(), atol=1e-4, rtol=1e-4)
        # ids may swap where two log-probs tie in float16 storage; the values may not
        torch.testing.assert_close(b.topk_logprobs, a.topk_logprobs, atol=2e-3, rtol=1e-3)


def test_a_qwen3_next_target_extracts_through_vllm(
    tiny_qwen3_next: Path, tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    """Qwen3-Next (linear attention in three layers of four, gated full attention with partial rotary, mixture of
    experts) through vLLM in bf16 (its CPU kernel for linear attention takes nothing else, so `auto` picks it on
    any CPU) agrees with the HF backend's fp32 cache to bf16's precision: the same samples, aux states within 2 %
    and the same top-1 token but where two candidates nearly tie."""
    from tiny import write_conversations

    from peagle_pipeline.cache.reader import open_cache

    data = write_conversations(tmp_path / "conv.jsonl", 16)
    flags = ["--topk", "8", "--layers", "0,1,2", "--max-length", "256", "--device", "cpu"]
    for backend, dtype in (("vllm", "bf16"), ("hf", "fp32")):
        proc = run_cli(
            vllm_env, "extract", "--model", str(tiny_qwen3_next), "--data", str(data),
            "--output", str(tmp_path / backend), "--backend", backend, "--dtype", dtype, *flags,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        # auto: bf16 also on a CPU without bf16 units, where auto means fp32 for other targets
        why = "compute dtype bf16 on cpu (auto: vLLM's CPU kernel for linear attention runs bf16 only)"
        assert backend == "hf" or why in proc.stdout + proc.stderr
    hf, vl = open_cache(tmp_path / "hf"), open_cache(tmp_path / "vllm")
    assert hf.samples["length"].equals(vl.samples["length"]) and len(hf.samples) == 16
    # fp32 through vLLM on a CPU: one line before the engine starts (its kernel asserts in the engine otherwise)
    proc = run_cli(
        vllm_env, "extract", "--model", str(tiny_qwen3_next), "--data", str(data), "--output",
        str(tmp_path / "fp32"), "--backend", "vllm", "--dtype", "fp32", "--compute-dtype", "fp32", *flags,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: vLLM on a CPU runs the linear attention")
    agree = rows = 0
    for sample_id in hf.samples["sample_id"].tolist():
        a, b = hf.read_sample(sample_id), vl.read_sample(sample_id)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        ref = a.aux_hidden.float()
        assert float((b.aux_hidden.float() - ref).norm() / ref.norm()) < 0.02
        agree += int((a.topk_ids[:, 0] == b.topk_ids[:, 0]).sum())
        rows += len(a.input_ids)
    assert agree >= 0.9 * rows
