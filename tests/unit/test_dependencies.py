"""The declared dependency ranges (pyproject.toml) admit the GPU machines' versions, and the exact CPU pins
(constraints/cpu.txt, used by `make setup`) sit inside those ranges and cover every requirement."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"

# What the GPU machines lent to this project run (docs/guides/gpus.md): python3's torch and transformers there.
GPU_MACHINE = {"torch": ["2.11.0", "2.11.0+cu130"], "transformers": ["5.17.0"]}
# Versions the tests were run against (transformers 4.56.2 / 4.57.6: backend, chat, extract, train, export).
CHECKED = {"torch": ["2.13.0+cpu"], "transformers": ["4.56.2", "4.57.6", "5.16.1", "5.19.0"]}


def _requirements(extras: tuple[str, ...] = ()) -> dict[str, Requirement]:
    reqs = list(PROJECT["dependencies"])
    for extra in extras:
        reqs += PROJECT["optional-dependencies"][extra]
    out: dict[str, Requirement] = {}
    for text in reqs:
        req = Requirement(text)
        out.setdefault(canonicalize_name(req.name), req)
    return out


def _pins() -> dict[str, Version]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints/cpu.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


@pytest.mark.parametrize("name", sorted(GPU_MACHINE))
def test_ranges_admit_the_gpu_machines_versions(name):
    spec = _requirements()[name].specifier
    for version in GPU_MACHINE[name] + CHECKED[name]:
        assert spec.contains(version), f"pyproject.toml's {name}{spec} refuses {version}"


def test_torch_range_starts_at_2_11():
    spec = _requirements()["torch"].specifier
    assert not spec.contains("2.10.1"), "torch below 2.11 was never checked: keep the lower bound at 2.11"
    assert spec.contains("2.11.0") and spec.contains("2.14.1")


def test_no_exact_pins_in_pyproject():
    exact = [
        str(r)
        for r in _requirements(tuple(PROJECT["optional-dependencies"])).values()
        if any(s.operator in ("==", "===") for s in r.specifier)
    ]
    assert not exact, f"exact pins belong in constraints/cpu.txt, not pyproject.toml: {exact}"


def test_constraints_pin_every_requirement_inside_its_range():
    pins = _pins()
    assert "peagle-pipeline" not in pins
    for name, req in _requirements(("dev", "test-s3", "test-trackers")).items():
        assert name in pins, f"constraints/cpu.txt has no pin for {name} (run scripts/pin_constraints.py)"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints/cpu.txt pins {name}=={pins[name]}, outside pyproject.toml's {req.specifier}"
        )
    assert pins["torch"].local == "cpu"  # the CPU wheel of these machines, never a CUDA build from PyPI
