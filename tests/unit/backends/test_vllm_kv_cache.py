"""backends/vllm.py: the KV cache size a vLLM engine on a CPU gets, from the memory this machine has available, and
the dtype `auto` means for a target vLLM runs in bf16 only on a CPU."""

from __future__ import annotations

from peagle_pipeline.backends.vllm import CPU_KV_CACHE_BYTES, CPU_KV_CACHE_MIN_BYTES, cpu_kv_cache_bytes


def _meminfo(tmp_path, available_kib: int | None) -> str:
    lines = ["MemTotal:       24000000 kB"]
    if available_kib is not None:
        lines.append(f"MemAvailable:   {available_kib} kB")
    path = tmp_path / "meminfo"
    path.write_text("\n".join(lines + ["Buffers:          100 kB"]) + "\n")
    return str(path)


def test_a_quarter_of_the_available_memory_up_to_the_cap(tmp_path):
    assert cpu_kv_cache_bytes(_meminfo(tmp_path, 20_000_000)) == CPU_KV_CACHE_BYTES  # 20 GB free: the cap
    assert cpu_kv_cache_bytes(_meminfo(tmp_path, 8 << 20)) == 2 << 30  # 8 GiB free: a quarter
    assert cpu_kv_cache_bytes(_meminfo(tmp_path, 1 << 20)) == CPU_KV_CACHE_MIN_BYTES  # 1 GiB free: the floor


def test_an_unreadable_meminfo_gives_the_cap(tmp_path):
    assert cpu_kv_cache_bytes(str(tmp_path / "missing")) == CPU_KV_CACHE_BYTES
    assert cpu_kv_cache_bytes(_meminfo(tmp_path, None)) == CPU_KV_CACHE_BYTES


def test_this_machine_gets_a_size_within_the_bounds():
    size = cpu_kv_cache_bytes()
    assert CPU_KV_CACHE_MIN_BYTES <= size <= CPU_KV_CACHE_BYTES


def test_auto_is_bf16_for_a_target_vllm_runs_in_bf16_only_on_a_cpu(tiny_qwen3_next, tiny_model):
    """generate: auto computes a linear-attention target (Qwen3-Next) in bf16 under vLLM on a CPU, whatever the CPU's
    bf16 speed; other targets, the HF backend and a given dtype follow the usual rule."""
    from peagle_pipeline.backends.vllm_dtype import cpu_runs_bf16_only
    from peagle_pipeline.config import GenerateConfig
    from peagle_pipeline.hardware import resolve_compute_dtype
    from peagle_pipeline.stages.generate.stage import _compute_dtype

    assert cpu_runs_bf16_only(str(tiny_qwen3_next)) and not cpu_runs_bf16_only(str(tiny_model))
    usual = resolve_compute_dtype("auto", "cpu")

    def dtype(model, backend, given="auto"):
        cfg = GenerateConfig(
            model=str(model), data=["d.jsonl"], output="o", device="cpu", compute_dtype=given
        )
        return _compute_dtype(cfg, backend)

    assert dtype(tiny_qwen3_next, "vllm") == "bf16" and dtype(tiny_qwen3_next, "vllm", "fp32") == "fp32"
    assert dtype(tiny_qwen3_next, "hf") == usual and dtype(tiny_model, "vllm") == usual


def test_the_bf16_only_reason_is_given_on_a_cpu_only(tiny_qwen3_next, tiny_model):
    """extract's dtype line and evaluate's engine use the same rule as generate (`engine_compute_dtype`)."""
    from peagle_pipeline.backends.vllm_dtype import CPU_BF16_ONLY, bf16_only_reason, engine_compute_dtype
    from peagle_pipeline.hardware import resolve_compute_dtype

    assert bf16_only_reason(str(tiny_qwen3_next), "cpu") == CPU_BF16_ONLY
    assert (
        bf16_only_reason(str(tiny_qwen3_next), "cuda:0") is None
        and bf16_only_reason(str(tiny_model), "cpu") is None
    )
    assert engine_compute_dtype("auto", str(tiny_qwen3_next), "cpu") == "bf16"
    assert engine_compute_dtype("auto", str(tiny_model), "cpu") == resolve_compute_dtype("auto", "cpu")
    assert engine_compute_dtype("fp32", str(tiny_qwen3_next), "cpu") == "fp32"
