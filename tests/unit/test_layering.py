"""The architecture, checked: imports point inward (docs/reference/architecture.md), no import circles, core stays
pure, importing is cheap.

Every import counts, wherever it stands (module level, inside a function, under TYPE_CHECKING) and in every form
(`import peagle_pipeline.x`, `from peagle_pipeline.x import y`, `from peagle_pipeline import x`, relative imports).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "peagle_pipeline"
ROOT = "peagle_pipeline"

# Which parts each part may import (besides itself). A part is a subpackage or a top-level module; "__init__" is
# the package itself (`from peagle_pipeline import __version__`). A dotted entry allows that one module only.
ALLOWED = {
    "errors": set(),
    "runtime": {"errors"},
    "hardware": {"errors"},  # the CPUs a process may use, bf16 units, the compute dtype chosen from them
    "target_info": {"errors"},  # TargetInfo, the default aux-layer rule, the layer and top-k checks
    "core": {"errors"},
    # the on-policy data format (data/onpolicy_files.py) is written as well as read: atomic files and rank locks
    # from runtime, the settings comparison on resume from core.settings
    "data": {"errors", "runtime", "core.settings"},
    "process_exit": set(),  # how a command's process ends (the CLI's exit without a final garbage collection)
    "preemption": {"errors"},  # SIGTERM/SIGINT handling, shared by the stages and the cache writer's commit
    "config": {"errors", "core.settings"},  # the COD defaults and checks, defined once (torch-free)
    # what a target model folder holds, read without loading the model
    "model_dir": {"errors", "target_info"},
    # the few tensors training needs, read from the folder's safetensors (quantised weights made dense by
    # core.quantized_weights)
    "target_weights": {"errors", "cache.layout", "model_dir", "core.quantized_weights"},
    # the cache contract's file names; the vLLM engine defaults (core.settings, torch-free, shared with config); the
    # target's logit scale (core.target_convention, read by training too)
    "backends": {
        "errors",
        "runtime",
        "hardware",
        "cache.layout",
        "core.settings",
        "core.target_convention",
        "model_dir",
        "target_info",
    },
    "cache": {"core", "runtime", "errors", "preemption"},
    "stages": {
        "__init__",
        "cache",
        "backends",
        "model_dir",
        "target_weights",
        "data",
        "core",
        "runtime",
        "hardware",
        "config",
        "errors",
        "preemption",
        "target_info",
    },
    "cli": {
        "__init__",
        "config",
        "errors",
        "stages",
        "cache",
        "runtime",
        "preemption",
        "process_exit",
        "cli_options",
    },
    "cli_options": {"config"},  # the CLI options built from the config dataclasses
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


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_module(name: str) -> bool:
    """Whether `name` (peagle_pipeline.a.b) is a module or package of ours (not an attribute)."""
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def _imports(path: Path, me: str | None = None) -> set[str]:
    """Every module named by an import in `path` (ours resolved to the module: `from a import b` -> a.b when b
    is a module, else a). `me`: the module name of `path` (default: from its place in the package)."""
    found: set[str] = set()
    me = me or _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base == ROOT or base.startswith(ROOT + "."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if _is_module(sub) else base)
            elif base:
                found.add(base)
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _ours() -> dict[str, set[str]]:
    """Our module -> the modules of ours it imports."""
    graph = {}
    for path in PKG.rglob("*.py"):
        graph[_module_name(path)] = {m for m in _imports(path) if m == ROOT or m.startswith(ROOT + ".")}
    return graph


def test_imports_point_inward():
    bad = []
    for module, targets in _ours().items():
        part = _part(module)
        for target in targets:
            other = _part(target)
            dotted = ".".join(target.split(".")[1:3])
            if other != part and other not in ALLOWED[part] and dotted not in ALLOWED[part]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    graph = _ours()
    cycles: set[tuple[str, ...]] = set()

    def visit(node: str, stack: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cycle = stack[stack.index(nxt) :]
                k = cycle.index(min(cycle))
                cycles.add(tuple(cycle[k:] + cycle[:k]))
            elif nxt not in done:
                visit(nxt, [*stack, nxt])
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert not cycles, "\n".join(" -> ".join([*c, c[0]]) for c in sorted(cycles))


def _command(module: str) -> str | None:
    """The command folder under stages/ a module belongs to (stages.train.loader -> train); None outside one."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "stages" and (PKG / "stages" / parts[2]).is_dir():
        return parts[2]
    return None


def test_commands_use_each_other_one_way():
    """A command may use another's pieces (train exports at the end, evaluate reads the export marker), never the
    other way round as well: what two commands both read (the run folder's records) sits beside them in stages/."""
    uses: set[tuple[str, str]] = set()
    for module, targets in _ours().items():
        for target in targets:
            a, b = _command(module), _command(target)
            if a and b and a != b:
                uses.add((a, b))
    both = sorted(f"{a} <-> {b}" for a, b in uses if (b, a) in uses and a < b)
    assert not both, "\n".join(both)
    assert ("train", "export") in uses  # the check sees the one use that is meant to be there


ARCHITECTURE = PKG.parent / "docs" / "reference" / "architecture.md"


def _documented_rooms() -> dict[str, set[str] | None]:
    """Room -> what docs/reference/architecture.md's table says it may import (None: "everything below")."""
    rooms: dict[str, set[str] | None] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not (line.startswith("| `") and len(cells) >= 3):
            continue
        room = cells[0].strip("`").removesuffix("/").removesuffix(".py")
        may = re.sub(r"\([^)]*\)", "", cells[-1])  # the notes in brackets go
        rooms[room] = (
            None
            if may.strip() == "everything below"
            else {w.strip() for w in may.split(",") if w.strip() and w.strip() != "nothing"}
        )
    return rooms


def test_the_architecture_page_lists_each_room_with_its_imports():
    """docs/reference/architecture.md's room table says what this test enforces: every room, and for each what it
    may import (the package's own `__init__` aside)."""
    rooms = _documented_rooms()
    assert set(rooms) == set(ALLOWED) - {"__init__"}, set(rooms) ^ (set(ALLOWED) - {"__init__"})
    wrong = {
        room: (sorted(may), sorted(ALLOWED[room] - {"__init__"}))
        for room, may in rooms.items()
        if may is not None and may != ALLOWED[room] - {"__init__"}
    }
    assert not wrong, wrong


def test_the_architecture_page_names_every_stage_module():
    """The stages/ row of docs/reference/architecture.md names each module under stages/ (`name` in backticks)."""
    row = next(line for line in ARCHITECTURE.read_text().splitlines() if line.startswith("| `stages/` |"))
    named = set(re.findall(r"`([a-z_]+)(?:\.py)?`", row))
    modules = {p.stem for p in (PKG / "stages").rglob("*.py") if p.stem != "__init__"}
    assert not modules - named, sorted(modules - named)


def test_the_checks_see_every_import_form(tmp_path):
    """The resolver itself: `from peagle_pipeline import x` and relative imports name the module imported."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from peagle_pipeline import config\nfrom . import layout\nfrom ..stages import train\n"
        "import peagle_pipeline.backends.base\nfrom peagle_pipeline import __version__\n"
    )
    found = _imports(probe, me="peagle_pipeline.cache.probe")
    assert {
        "peagle_pipeline.config",
        "peagle_pipeline.cache.layout",
        "peagle_pipeline.stages.train",
        "peagle_pipeline.backends.base",
        "peagle_pipeline",
    } <= found


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


def test_importing_package_config_and_cli_does_not_import_torch():
    code = "import sys, peagle_pipeline, peagle_pipeline.config, peagle_pipeline.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
