"""The architecture, checked: imports point inward (STYLE.md), core stays pure, importing is cheap."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "peagle_pipeline"

# Which top-level parts each part may import (besides itself).
ALLOWED = {
    "core": {"errors"},
    "data": {"errors"},
    "backends": {"errors", "config", "data", "runtime"},
    "cache": {"core", "runtime", "errors", "config", "backends", "data", "preemption"},
    "stages": {"cache", "backends", "data", "core", "runtime", "config", "errors", "preemption"},
    "cli": {"config", "errors", "stages", "cache", "preemption"},
    "preemption": {"errors"},
    "config": {"errors"},
    "runtime": {"errors"},
    "errors": set(),
    "__init__": {"cache"},
}
FORBIDDEN_IN_CORE = {
    "os",
    "zarr",
    "pandas",
    "pyarrow",
    "safetensors",
    "yaml",
    "typer",
    "tqdm",
    "random",
    "requests",
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _part(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_imports_point_inward():
    bad = []
    for path in PKG.rglob("*.py"):
        part = _part(path)
        for mod in _imports(path):
            if mod.startswith("peagle_pipeline."):
                target = mod.split(".")[1]
                if target != part and target not in ALLOWED.get(part, set()):
                    bad.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_core_is_pure():
    bad = []
    for path in (PKG / "core").glob("*.py"):
        for mod in _imports(path):
            if mod.split(".")[0] in FORBIDDEN_IN_CORE:
                bad.append(f"core/{path.name} imports {mod}")
        text = path.read_text()
        for needle in ("torch.manual_seed(", "open(", "os.environ", "print("):
            if needle in text:
                bad.append(f"core/{path.name} uses {needle}")
    assert not bad, "\n".join(bad)


def test_importing_package_and_cli_does_not_import_torch():
    code = "import sys, peagle_pipeline, peagle_pipeline.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
