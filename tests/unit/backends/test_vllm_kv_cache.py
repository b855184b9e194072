"""backends/vllm.py: the KV cache size a vLLM engine on a CPU gets, from the memory this machine has available."""

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
