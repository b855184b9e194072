"""What this machine offers a stage: the CPUs the process may use, the CPU's bf16 units, and the compute dtype
chosen from them (`resolve_compute_dtype`, with the one line that says why, `describe_compute_dtype`).

Importing it has no side effects: torch is imported lazily, the environment and /proc/cpuinfo are read only when a
function is called.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

from peagle_pipeline.errors import BadConfig

__all__ = [
    "CPU_BF16_ENV",
    "usable_cpus",
    "cpu_has_bf16_units",
    "cpu_bf16_flags",
    "cpu_vendor",
    "bf16_is_fast",
    "cpu_prefers_bf16",
    "resolve_compute_dtype",
    "describe_compute_dtype",
]

# Set to 1 or 0 to override the CPU bf16 detection (tests exercise both branches on one host with it).
CPU_BF16_ENV = "PEAGLE_CPU_BF16"
# /proc/cpuinfo flags of the x86 units that run bf16 matmuls at full speed. Without them, bf16
# matmuls are emulated: 16.8 vs 48.1 GFLOP/s in fp32 per thread on a Xeon with AVX512 but no bf16 units.
_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# Having the units is not enough, and `auto` must not depend on a timing (a 0.2 s one chose fp32 once in five runs of
# one command on an idle host, so one command wrote differently computed caches). What the CPU declares decides:
# AMX runs bf16 matmuls at full speed; AVX512-BF16 alone did on an AMD EPYC (bf16 matmul 2.4-3.1x fp32, extraction
# and the training step 2.0-2.6x) but not on a 2-core Intel Xeon without AMX (0.52x, extraction and the training
# step 0.64x). So AVX512-BF16 without AMX counts on AMD CPUs only.
_AVX512_BF16_FAST_VENDORS = ("AuthenticAMD",)


def usable_cpus() -> int:
    """The logical CPUs this process may run on (its affinity set, e.g. a container's cpuset), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------- compute dtype
@functools.cache
def _cpuinfo() -> tuple[frozenset[str], str]:
    """The flags and vendor id /proc/cpuinfo declares for the first CPU (empty on other systems)."""
    flags: frozenset[str] = frozenset()
    vendor = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:  # not Linux: only torch's probes
        pass
    return flags, vendor


@functools.cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """The bf16 units of this CPU that torch can use: a subset of ("amx_bf16", "avx512_bf16").

    Read from /proc/cpuinfo (Linux) and torch's own CPU probes; avx512_bf16 counts only when torch's kernels
    run at the AVX512 level (`torch.backends.cpu.get_cpu_capability()`; ATEN_CPU_CAPABILITY=avx2 turns it off).
    Cached: the hardware does not change while the process runs.
    """
    import torch

    found = set(_cpuinfo()[0] & set(_BF16_FLAGS))
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


def cpu_vendor() -> str:
    """The CPU vendor id /proc/cpuinfo declares ("AuthenticAMD", "GenuineIntel"; "" where it is not read)."""
    return _cpuinfo()[1]


def bf16_is_fast(flags: tuple[str, ...], vendor: str) -> bool:
    """Whether a CPU with bf16 units `flags` from `vendor` runs bf16 matmuls faster than fp32 ones: with AMX, or
    with AVX512-BF16 on a vendor whose AVX512-BF16 alone was measured faster (see `_AVX512_BF16_FAST_VENDORS`)."""
    return "amx_bf16" in flags or ("avx512_bf16" in flags and vendor in _AVX512_BF16_FAST_VENDORS)


def cpu_prefers_bf16() -> bool:
    """True when `auto` should compute in bf16 on this CPU: from what it declares (`bf16_is_fast`), never from a
    timing, so that one command on one host always computes alike; `PEAGLE_CPU_BF16=0|1` overrides.

    Raises:
        BadConfig: PEAGLE_CPU_BF16 set to something other than 0 or 1.
    """
    if os.environ.get(CPU_BF16_ENV, "").strip():
        return cpu_has_bf16_units()
    return bf16_is_fast(cpu_bf16_flags(), cpu_vendor())


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

    auto: bf16 on CUDA (fp32 on a GPU older than Ampere, which has no bf16 units); on a CPU, bf16 where what it
    declares (its bf16 units and vendor, `cpu_prefers_bf16`) runs bf16 matmuls faster than fp32 ones, else fp32;
    fp32 on any other device type. The same rule serves vLLM's CPU backend: on the Xeon where torch's bf16 matmul ran 0.52x fp32, vLLM's
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
            why = (
                f"auto: this CPU has bf16 units ({units}), which run bf16 matmuls faster than fp32"
                if chosen == "bf16"
                else f"auto: this CPU has bf16 units ({units}) but no AMX, on {cpu_vendor() or 'an unknown vendor'}"
                " (AVX512-BF16 alone ran bf16 matmuls 0.52x fp32 on an Intel Xeon), so fp32"
            )
    else:
        why = "auto"
    return f"compute dtype {chosen} on {device} ({why})"
