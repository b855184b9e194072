"""The house's size rules (docs/reference/architecture.md): one idea per module, short functions, few parameters.

A module over MAX_MODULE_LINES or a function over MAX_FUNCTION_LINES (its whole span, docstring included) is a
sign that it holds more than one idea: split it by idea, as `stages/extract/` and `config/` are split.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "peagle_pipeline"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 7
"""A function that needs more is handed an object (a dataclass of what belongs together), not a longer list."""


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


def _many_parameters(path: Path, limit: int) -> list[str]:
    """Each function of `path` with more than `limit` parameters (self and cls not counted), as "name:line (N)"."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            if count > limit:
                out.append(f"{n.name}:{n.lineno} ({count})")
    return out


def test_no_function_takes_more_than_seven_parameters():
    many = [
        f"{p.relative_to(PKG.parent)} {f}" for p in _modules() for f in _many_parameters(p, MAX_PARAMETERS)
    ]
    assert not many, "hand these an object: " + ", ".join(many)


def test_the_check_sees_a_long_parameter_list(tmp_path):
    (tmp_path / "probe.py").write_text(
        "def seven(self, a, b, c, d, e, f, g):\n    pass\n\n\ndef eight(a, b, c, d, e, f, g, *h):\n    pass\n"
    )
    assert _many_parameters(tmp_path / "probe.py", MAX_PARAMETERS) == ["eight:5 (8)"]
