"""`pip install` of the package into an environment that already has its own torch leaves that torch in place,
and the CLI works there (install beside the torch a GPU user's vLLM pinned).

What runs offline here: a fresh venv (a real one, not --system-site-packages) gets torch from the local wheel that
pip's find-links serve; the other dependencies cannot be downloaded, so the venv borrows them read-only from
this test's environment through a .pth file, which Python appends *after* the venv's own site-packages: the
venv's torch and peagle-pipeline are the ones imported (asserted). Then a real, dependency-resolving
`pip install` of our wheel (no index) must install nothing but peagle-pipeline, and a control wheel whose
metadata asks for a torch nobody has must be refused, so the check can fail. The ranges themselves (admitting the
GPU machines' torch 2.11) are checked in tests/unit/test_dependencies.py; the same install on a real torch-2.11
GPU machine is the first step of scripts/gpu_tier.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(*cmd: str | Path, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def _build_wheel(tmp: Path, name: str, torch_requirement: str | None = None) -> Path:
    """Our wheel, built from a copy of the sources (the checkout gets no build/ or egg-info)."""
    src = tmp / f"src-{name}"
    src.mkdir()
    for item in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / item, src / item)
    shutil.copytree(
        ROOT / "peagle_pipeline", src / "peagle_pipeline", ignore=shutil.ignore_patterns("__pycache__")
    )
    if torch_requirement is not None:
        text = (src / "pyproject.toml").read_text()
        start = text.index('"torch')
        end = text.index('"', start + 1)
        (src / "pyproject.toml").write_text(text[:start] + f'"{torch_requirement}' + text[end:])
    dist = tmp / f"dist-{name}"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", dist, src, cwd=tmp)  # fmt: skip
    (wheel,) = dist.glob("peagle_pipeline-*.whl")
    return wheel


def test_pip_install_keeps_the_environments_torch_and_the_cli_works(tmp_path):
    import torch

    venv = tmp_path / "venv"
    try:
        _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
        py = venv / "bin" / "python"
        # The venv's bundled setuptools is older than torch's requirement: let the borrowed one serve instead.
        _run(py, "-m", "pip", "uninstall", "-q", "-y", "setuptools", cwd=tmp_path, check=False)
        got = _run(py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", f"torch=={torch.__version__}",
                   cwd=tmp_path, check=False)  # fmt: skip
        if got.returncode:
            pytest.skip(f"no local torch {torch.__version__} wheel for an offline venv (pip's find-links)")
        purelib = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
                       .stdout.strip())  # fmt: skip
        (purelib / "zz_borrowed_from_tests.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        probe = "import torch; print(torch.__version__); print(torch.__file__)"
        before = _run(py, "-c", probe, cwd=tmp_path).stdout.split()
        assert before[0] == torch.__version__ and before[1].startswith(str(venv))

        control = _build_wheel(tmp_path, "control", "torch>=99")
        refused = _run(py, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", control.parent,
                       control, cwd=tmp_path, check=False)  # fmt: skip
        # pip names the torch requirement on stderr, or, where a pip constraint file caps torch (some hosts have
        # /etc/xdg/pip/constraints.txt), in its "conflict is caused by" lines on stdout
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "torch>=99" in said, said[-2000:]

        wheel = _build_wheel(tmp_path, "ours")
        report = tmp_path / "report.json"
        _run(py, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheel.parent, "--report", report,
             wheel, cwd=tmp_path)  # fmt: skip
        installed = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
        assert installed == ["peagle-pipeline"], f"pip wanted to install or replace {installed}"

        assert _run(py, "-c", probe, cwd=tmp_path).stdout.split() == before  # the same torch, in place
        where = _run(py, "-c", "import peagle_pipeline; print(peagle_pipeline.__file__)", cwd=tmp_path)
        assert where.stdout.strip().startswith(str(venv))
        helped = _run(venv / "bin" / "peagle-pipeline", "--help", cwd=tmp_path)
        assert "extract" in helped.stdout and "train" in helped.stdout
        imports = _run(
            py, "-c", "import peagle_pipeline.core.mask, peagle_pipeline.stages.train.stage", cwd=tmp_path
        )
        assert imports.returncode == 0
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # ~0.8 GB of torch
