"""Packaging metadata: pyproject.toml builds without setuptools deprecation warnings."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_license_is_an_spdx_string_and_build_needs_setuptools_77() -> None:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"  # PEP 639 SPDX expression, not a {text = ...} table
    requires = doc["build-system"]["requires"]
    assert "setuptools>=77" in requires, requires  # first setuptools that reads SPDX license strings


def test_setuptools_reads_pyproject_without_deprecation_warnings() -> None:
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    messages = [str(w.message).splitlines()[0] for w in caught if "license" in str(w.message).lower()]
    assert messages == []
    assert dist.metadata.license_expression == "Apache-2.0"
