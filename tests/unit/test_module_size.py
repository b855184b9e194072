"""The house's size rules (docs/reference/architecture.md): one idea per module, short functions.

A module over MAX_MODULE_LINES or a function over MAX_FUNCTION_LINES (its whole span, docstring included) is a
sign that it holds more than one idea: split it by idea, as `stages/extract/` and `config/` are split.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "peagle_pipeline"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _long_functions(path: Path, limit: int) -> list[str]:
    """Each function of `path` whose span is over `limit` lines, as "name:line (N lines)"."""
    return [
        f"{n.name}:{n.lineno} ({n.end_lineno - n.lineno + 1} lines)"
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit
    ]


def test_no_module_is_over_the_limit():
    long = [
        f"{p.relative_to(PKG.parent)} ({n} lines)"
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "split by idea: " + ", ".join(long)


def test_no_function_is_over_the_limit():
    long = [
        f"{p.relative_to(PKG.parent)} {f}" for p in _modules() for f in _long_functions(p, MAX_FUNCTION_LINES)
    ]
    assert not long, "split into named steps: " + ", ".join(long)


def test_the_check_sees_a_long_function(tmp_path):
    """The checker itself: a 61-line function is found, a 60-line one is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (tmp_path / "probe.py").write_text(f"def short():\n{body}\n\n\ndef long():\n{body}\n    x = 0\n")
    assert _long_functions(tmp_path / "probe.py", MAX_FUNCTION_LINES) == ["long:63 (61 lines)"]
