"""scripts/wheel_closure.py, the helpers of scripts/gpu_wheels.sh --speculators: a wheel's unconditional
requirements, an installable empty torch wheel for the resolver, and what is carried (the resolved closure less
torch with its CUDA stack and less our own direct requirements) and installed (only what is missing)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import wheel_closure  # noqa: E402


def _wheel(path: Path, requires: list[str]) -> Path:
    meta = "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", meta)
    return path


def test_requires_drops_extras_and_named_packages(tmp_path: Path) -> None:
    wheel = _wheel(
        tmp_path / "demo-1.0-py3-none-any.whl",
        [
            "openai>=2.0.0",
            "torch<=2.14.1,>=2.9.0",
            "torchvision",
            "numpy<=2.5.4,>=2.0.0",
            'tomli; python_version < "3.11"',
            'pytest~=9.1.1; extra == "dev"',
            'scipy; extra=="dev"',
        ],
    )
    got = wheel_closure.requires(str(wheel), {"torch", "torchvision"})
    assert got == ["openai>=2.0.0", "numpy<=2.5.4,>=2.0.0", 'tomli; python_version < "3.11"']


def test_stub_wheel_installs_and_declares_nothing(tmp_path: Path) -> None:
    stub = wheel_closure.stub("torch", "2.11.0", str(tmp_path))
    assert stub.name == "torch-2.11.0-py3-none-any.whl"
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(target),
            str(stub),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (target / "torch-2.11.0.dist-info" / "METADATA").is_file()
    assert not list(target.glob("torch/*"))  # nothing importable: the GPU machine's torch is the real one


def test_carry_leaves_out_torch_and_our_requirements(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    names = [
        "openai",
        "httpx2",
        "torch",
        "nvidia-cudnn-cu12",
        "triton",
        "Pandas",
        "transformers",
        "typing_extensions",
    ]
    report.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": "1.0"}} for n in names]}))
    ours = tmp_path / "ours.txt"
    ours.write_text("torch>=2.11,<3\npandas>=2.1\ntransformers>=4.56,<6\n")
    assert wheel_closure.carry(str(report), str(ours)) == [
        "httpx2==1.0",
        "openai==1.0",
        "typing-extensions==1.0",
    ]


def test_missing_lists_only_what_is_not_installed(tmp_path: Path) -> None:
    carried = tmp_path / "carry.txt"
    carried.write_text("pytest==0.0.1\nno-such-distribution-here==1.0\n")
    assert wheel_closure.missing(str(carried)) == ["no-such-distribution-here==1.0"]


def test_missing_wheels_never_replaces_an_installed_distribution(tmp_path: Path) -> None:
    # pytest is installed here (in some version): its wheel must not be offered, whatever version it carries, since
    # `pip install --no-deps` would replace the machine's (huggingface-hub 2.x under transformers 5.17 fails import).
    base, extra = tmp_path / "base", tmp_path / "extra"
    base.mkdir()
    extra.mkdir()
    for folder, name in (
        (base, "pytest-0.0.1"),
        (base, "no_such_distribution_here-1.0"),
        (extra, "Other.Pkg-2.0"),
    ):
        (folder / f"{name}-py3-none-any.whl").write_bytes(b"")
    (extra / "speculators-carry.txt").write_text("pytest==0.0.1\n")
    got = wheel_closure.missing_wheels([str(base), str(extra)], skip={"other-pkg"})
    assert got == [str(base / "no_such_distribution_here-1.0-py3-none-any.whl")]
