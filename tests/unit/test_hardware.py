"""hardware: the compute dtype chosen from the hardware (both CPU branches, via PEAGLE_CPU_BF16; the rule on what a
CPU declares, never a timing), its log line, and the CPUs this process may use."""

from __future__ import annotations

import os

import pytest
import torch

from peagle_pipeline.errors import BadConfig
from peagle_pipeline.hardware import (
    CPU_BF16_ENV,
    bf16_is_fast,
    cpu_bf16_flags,
    cpu_has_bf16_units,
    cpu_prefers_bf16,
    cpu_vendor,
    describe_compute_dtype,
    resolve_compute_dtype,
    usable_cpus,
)


def _proc_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("requested", ["bf16", "fp32"])
@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "mps"])
def test_explicit_dtype_is_kept_on_every_device(requested, device, monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0" if requested == "bf16" else "1")  # the hardware must not matter
    assert resolve_compute_dtype(requested, device) == requested


def test_auto_on_cpu_follows_the_bf16_units(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert cpu_has_bf16_units() and cpu_prefers_bf16() and resolve_compute_dtype("auto", "cpu") == "bf16"
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert (
        not cpu_has_bf16_units() and not cpu_prefers_bf16() and resolve_compute_dtype("auto", "cpu") == "fp32"
    )
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(BadConfig, match=CPU_BF16_ENV):
        cpu_has_bf16_units()


def test_auto_without_override_reads_this_cpu(monkeypatch):
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    flags = cpu_bf16_flags()
    assert set(flags) <= {"amx_bf16", "avx512_bf16"}
    proc = _proc_flags()
    avx512_level = "AVX512" in torch.backends.cpu.get_cpu_capability()
    if "amx_bf16" in proc or ("avx512_bf16" in proc and avx512_level):
        assert flags, (
            f"/proc/cpuinfo lists bf16 units but none were detected ({sorted(proc & {'amx_bf16', 'avx512_bf16'})})"
        )
    if not proc & {"amx_bf16", "avx512_bf16"} and proc:
        assert not flags
    # the units are not enough: AVX512-BF16 without AMX counts on AMD only (an Intel Xeon ran bf16 0.52x fp32)
    fast = bf16_is_fast(flags, cpu_vendor())
    assert cpu_prefers_bf16() == fast
    assert resolve_compute_dtype("auto", "cpu") == ("bf16" if fast else "fp32")


@pytest.mark.parametrize(
    ("flags", "vendor", "fast"),
    [
        (("amx_bf16", "avx512_bf16"), "GenuineIntel", True),
        (("amx_bf16",), "GenuineIntel", True),
        (("avx512_bf16",), "GenuineIntel", False),  # 0.52x fp32 on a 2-core Xeon without AMX
        (("avx512_bf16",), "AuthenticAMD", True),  # 2.4-3.1x fp32 on an AMD EPYC
        ((), "AuthenticAMD", False),  # emulated bf16
        ((), "GenuineIntel", False),
        (("avx512_bf16",), "", False),
    ],
)
def test_bf16_is_decided_from_what_the_cpu_declares(flags, vendor, fast):
    assert bf16_is_fast(flags, vendor) is fast


def test_auto_never_times_a_matmul(monkeypatch):
    """One command on one host computes alike every time: `auto` reads the CPU's declarations, it times nothing
    (a 0.2 s timing chose fp32 in one of five identical extractions)."""
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    cpu_bf16_flags()  # (its probes may multiply; the choice below may not)

    def timed(*args, **kwargs):
        raise AssertionError("auto timed a matmul")

    for name in ("mm", "matmul", "bmm"):
        monkeypatch.setattr(torch, name, timed)
    chosen = resolve_compute_dtype("auto", "cpu")
    assert {resolve_compute_dtype("auto", "cpu") for _ in range(5)} == {chosen}
    assert describe_compute_dtype("auto", "cpu", chosen).startswith(f"compute dtype {chosen} on cpu (auto: ")


def test_auto_on_gpus_and_other_devices(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0")  # CPU detection must not leak into the CUDA choice
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability(0)[0]
        assert resolve_compute_dtype("auto", "cuda:0") == ("bf16" if major >= 8 else "fp32")
    else:
        assert resolve_compute_dtype("auto", "cuda") == "bf16"
        assert resolve_compute_dtype("auto", "cuda:3") == "bf16"
    assert resolve_compute_dtype("auto", "mps") == "fp32"
    with pytest.raises(BadConfig, match="auto, bf16 or fp32"):
        resolve_compute_dtype("fp16", "cpu")


def test_describe_says_what_and_why(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert (
        describe_compute_dtype("auto", "cpu", "fp32") == f"compute dtype fp32 on cpu (auto: {CPU_BF16_ENV}=0)"
    )
    assert describe_compute_dtype("bf16", "cpu", "bf16") == "compute dtype bf16 on cpu (set in the config)"
    monkeypatch.delenv(CPU_BF16_ENV)
    chosen = resolve_compute_dtype("auto", "cpu")
    line = describe_compute_dtype("auto", "cpu", chosen)
    assert ("has bf16 units" in line) == bool(cpu_bf16_flags())
    assert ("no bf16 units" in line) == (not cpu_bf16_flags())
    if cpu_bf16_flags():  # the rule is the reason given, whichever way it went
        assert line.endswith("so fp32)") == (chosen == "fp32")
        assert line.endswith("faster than fp32)") == (chosen == "bf16")


def test_usable_cpus_is_the_affinity_set():
    """The CPUs of the process's affinity set, not all of the machine's: a process pinned to one CPU has one."""
    assert usable_cpus() == len(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)
