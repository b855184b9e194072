"""What this machine offers a stage: the CPUs the process may use, the CPU's bf16 units, and the compute dtype
chosen from them (`resolve_compute_dtype`, with the one line that says why, `describe_compute_dtype`).

Importing it has no side effects: torch is imported lazily, the environment and /proc/cpuinfo are read only when a
function is called.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Literal

from peagle_pipeline.errors import BadConfig

__all__ = [
    "CPU_BF16_ENV",
    "BF16_MIN_SPEEDUP",
    "usable_cpus",
    "cpu_has_bf16_units",
    "cpu_bf16_flags",
    "cpu_bf16_speedup",
    "cpu_prefers_bf16",
    "resolve_compute_dtype",
    "describe_compute_dtype",
]

# Set to 1 or 0 to override the CPU bf16 detection (tests exercise both branches on one host with it).
CPU_BF16_ENV = "PEAGLE_CPU_BF16"
# /proc/cpuinfo flags of the x86 units that run bf16 matmuls at full speed. Without them, bf16
# matmuls are emulated: 16.8 vs 48.1 GFLOP/s in fp32 per thread on a Xeon with AVX512 but no bf16 units.
_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# Having the units is not enough: on a 2-core Xeon with AVX512-BF16 and no AMX, torch's bf16 matmul ran 0.52x its
# fp32 one (167 vs 321 GFLOP/s) and extraction and the training step 0.64x; on an AMD EPYC with AVX512-BF16 they
# ran 2.6x and 2.0x. So `auto` measures: bf16 only where its matmul is at least this much faster than fp32's.
BF16_MIN_SPEEDUP = 1.1


def usable_cpus() -> int:
    """The logical CPUs this process may run on (its affinity set, e.g. a container's cpuset), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------- compute dtype
@functools.cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """The bf16 units of this CPU that torch can use: a subset of ("amx_bf16", "avx512_bf16").

    Read from /proc/cpuinfo (Linux) and torch's own CPU probes; avx512_bf16 counts only when torch's kernels
    run at the AVX512 level (`torch.backends.cpu.get_cpu_capability()`; ATEN_CPU_CAPABILITY=avx2 turns it off).
    Cached: the hardware does not change while the process runs.
    """
    import torch

    found: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    found |= set(line.split(":", 1)[1].split()) & set(_BF16_FLAGS)
                    break
    except OSError:  # not Linux: only torch's probes below
        pass
    probes = {"avx512_bf16": "_is_avx512_bf16_supported"}  # private but stable since torch 2.3; optional
    for flag, name in probes.items():
        probe = getattr(torch.cpu, name, None)
        if probe is not None:
            try:
                if probe():
                    found.add(flag)
            except RuntimeError:
                pass
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        found.discard("avx512_bf16")
    return tuple(f for f in _BF16_FLAGS if f in found)


@functools.cache
def cpu_bf16_speedup() -> float:
    """bf16 over fp32 matmul throughput of torch on this CPU at its current thread count, e.g. 2.6 or 0.52.

    Measured once per process (about 0.1 s): a (512, 576) x (576, 1536) product, the shape of a small model's
    projections, timed in both dtypes in alternating rounds; the best time of each counts. Where bf16 is emulated
    (about 1 % of fp32's speed, one such product taking a second) it stops after the first round that shows bf16
    more than 4x slower: no later round turns that around.
    """
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 576, generator=gen), torch.randn(576, 1536, generator=gen)
    pairs = {"fp32": (a, b), "bf16": (a.bfloat16(), b.bfloat16())}
    best = dict.fromkeys(pairs, float("inf"))
    for _ in range(4):
        for name, (x, y) in pairs.items():
            torch.mm(x, y)  # a warm-up call in every round: the first round also allocates
            start = time.perf_counter()
            for _ in range(3):
                torch.mm(x, y)
            best[name] = min(best[name], time.perf_counter() - start)
        if best["bf16"] > 4 * best["fp32"]:
            break
    return best["fp32"] / max(best["bf16"], 1e-9)


def cpu_prefers_bf16() -> bool:
    """True when `auto` should compute in bf16 on this CPU: it has bf16 units and its bf16 matmul beats fp32's
    by BF16_MIN_SPEEDUP (`cpu_bf16_speedup`); `PEAGLE_CPU_BF16=0|1` overrides both.

    Raises:
        BadConfig: PEAGLE_CPU_BF16 set to something other than 0 or 1.
    """
    if os.environ.get(CPU_BF16_ENV, "").strip():
        return cpu_has_bf16_units()
    return bool(cpu_bf16_flags()) and cpu_bf16_speedup() >= BF16_MIN_SPEEDUP


def cpu_has_bf16_units() -> bool:
    """True when this CPU multiplies bf16 in hardware (AMX or AVX512-BF16); `PEAGLE_CPU_BF16=0|1` overrides.

    Raises:
        BadConfig: PEAGLE_CPU_BF16 set to something other than 0 or 1.
    """
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise BadConfig(f"{CPU_BF16_ENV} must be 0 or 1, got {forced!r}")
        return forced == "1"
    return bool(cpu_bf16_flags())


def resolve_compute_dtype(requested: str, device: str) -> Literal["bf16", "fp32"]:
    """The dtype a forward/backward computes in: `requested` unless it is `auto`.

    auto: bf16 on CUDA (fp32 on a GPU older than Ampere, which has no bf16 units); on a CPU, bf16 where torch's
    bf16 matmul is measured faster than its fp32 one (`cpu_prefers_bf16`), else fp32; fp32 on any other device
    type. The same rule serves vLLM's CPU backend: on the Xeon where torch's bf16 matmul ran 0.52x fp32, vLLM's
    greedy decoding ran 0.74x (183 vs 246 tokens/s). This is the compute dtype only; what a stage stores is its
    own setting.

    Args:
        requested: "auto", "bf16" or "fp32".
        device: an already resolved device string ("cpu", "cuda", "cuda:1").

    Raises:
        BadConfig: `requested` is none of the three.
    """
    if requested in ("bf16", "fp32"):
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise BadConfig(f"compute dtype must be auto, bf16 or fp32; got {requested!r}")
    kind = device.split(":", 1)[0]
    if kind == "cuda":
        import torch

        if torch.cuda.is_available():
            major, _ = torch.cuda.get_device_capability(device)
            return "bf16" if major >= 8 else "fp32"
        return "bf16"
    if kind == "cpu":
        return "bf16" if cpu_prefers_bf16() else "fp32"
    return "fp32"


def describe_compute_dtype(requested: str, device: str, chosen: str) -> str:
    """One line for the start of a stage, saying the dtype and why, e.g.
    `compute dtype fp32 on cpu (auto: this CPU has no bf16 units (AMX / AVX512-BF16); fp32 is faster here)`."""
    if requested != "auto":
        why = "set in the config"
    elif device.split(":", 1)[0] == "cpu":
        forced = os.environ.get(CPU_BF16_ENV, "").strip()
        if forced:
            why = f"auto: {CPU_BF16_ENV}={forced}"
        elif not cpu_bf16_flags():
            why = "auto: this CPU has no bf16 units (AMX / AVX512-BF16), so fp32 is faster"
        else:
            units = ", ".join(cpu_bf16_flags())
            speed = f"bf16 matmul {cpu_bf16_speedup():.2f}x fp32 here"
            why = (
                f"auto: this CPU has bf16 units ({units}), {speed}"
                if chosen == "bf16"
                else (f"auto: this CPU has bf16 units ({units}) but {speed}, so fp32 is faster")
            )
    else:
        why = "auto"
    return f"compute dtype {chosen} on {device} ({why})"
