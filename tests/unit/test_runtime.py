"""runtime: the compute dtype chosen from the hardware (both CPU branches, via PEAGLE_CPU_BF16), and its log line."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.errors import BadConfig
from peagle_pipeline.runtime import (
    CPU_BF16_ENV,
    cpu_bf16_flags,
    cpu_has_bf16_units,
    describe_compute_dtype,
    resolve_compute_dtype,
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
    assert cpu_has_bf16_units() and resolve_compute_dtype("auto", "cpu") == "bf16"
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert not cpu_has_bf16_units() and resolve_compute_dtype("auto", "cpu") == "fp32"
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
    expected = "bf16" if flags else "fp32"
    assert resolve_compute_dtype("auto", "cpu") == expected


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
    line = describe_compute_dtype("auto", "cpu", resolve_compute_dtype("auto", "cpu"))
    assert ("has bf16 units" in line) == bool(cpu_bf16_flags())
    assert ("no bf16 units" in line) == (not cpu_bf16_flags())


def test_create_exclusive(tmp_path):
    from peagle_pipeline.runtime import create_exclusive

    path = tmp_path / "meta.json"
    assert create_exclusive(path, "first\n") and not create_exclusive(path, "second\n")
    assert path.read_text() == "first\n" and [p.name for p in tmp_path.iterdir()] == ["meta.json"]
