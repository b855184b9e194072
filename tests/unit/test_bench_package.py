"""bench/ is a package run from the repository root (`python -m bench.bench_x`, docs/results/benchmarks.md): none of its
modules edits sys.path or imports from tests/ (tests import from bench, never the other way), and each one imports
as `bench.<name>`."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
MODULES = sorted(p for p in BENCH.glob("*.py") if p.name != "__init__.py")
# What a bench module could only reach through tests/ on sys.path: the helper modules at its top, the reference step.
TEST_MODULES = {p.stem for p in (REPO / "tests").glob("*.py")} | {"tests", "reference"}
BENCH_NAMES = {p.stem for p in MODULES}


def _problems(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and getattr(node.value, "id", None) == "sys"
        ):
            found.append(f"line {node.lineno}: sys.path")
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in TEST_MODULES:
                found.append(f"line {node.lineno}: imports {name} from tests/")
            elif top in BENCH_NAMES:
                found.append(
                    f"line {node.lineno}: imports {name} as a script would (bench.{top} as a package)"
                )
    return found


def test_the_benchmarks_are_found() -> None:
    assert (BENCH / "__init__.py").is_file()
    assert {"run_all", "common", "bench_step", "bench_extract"} <= BENCH_NAMES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_sys_path_edits_nor_imports_from_tests(path: Path) -> None:
    assert _problems(path) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_imports_as_a_module_of_the_package(path: Path) -> None:
    module = importlib.import_module(f"bench.{path.stem}")
    assert Path(module.__file__).resolve() == path.resolve()
