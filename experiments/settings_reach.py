"""How far a command's settings travel: from its entry point through the calls that pass them on (a static trace).

    python experiments/settings_reach.py [--values] [--types A,B,...] [--list] [--via]
    python experiments/settings_reach.py --entry peagle_pipeline.stages.train.stage.run --param cfg=TrainConfig \
        --types TrainConfig

A settings object is a value whose type is one of --types (default: extract's ExtractConfig, TargetStageConfig,
ExtractPlan, Settled, BackendSettings, EngineSettings; add CacheMeta to follow the cache's record to the writer).
Types come from annotations: parameters, return values (tuples and NamedTuples unpacked), class fields;
`dataclasses.replace(x, ...)` keeps x's type. A stop is a function that receives a settings object as an argument
(with --values: or any attribute read off one), a class built with one (its constructor and the methods that read
the field), or a method of such a class called on it. A file is touched when it holds a stop. Reads the source
only (ast); calls through callbacks and dynamic dispatch the annotations do not name are not followed.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

_p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_p.add_argument("--root", default=".", help="the repository root (default: the working directory)")
_p.add_argument(
    "--entry", default="peagle_pipeline.stages.extract.stage.run", help="the function traced from"
)
_p.add_argument("--param", default="cfg=ExtractConfig", help="NAME=Type: the entry's settings parameter")
_p.add_argument(
    "--types",
    default="ExtractConfig,TargetStageConfig,ExtractPlan,Settled,BackendSettings,EngineSettings",
    help="comma-separated class names counted as settings",
)
_p.add_argument("--values", action="store_true", help="also follow attributes read off a settings object")
_p.add_argument("--list", action="store_true", help="list the stops, file by file")
_p.add_argument("--via", action="store_true", help="with --list: the call that reached each stop")
ARGS = _p.parse_args()
root = Path(ARGS.root)
TYPES = set(ARGS.types.split(","))
VALUES = ARGS.values
PKG = "peagle_pipeline"
ENTRY = ARGS.entry
_PNAME, _, _PTYPE = ARGS.param.partition("=")


def modname(p: Path) -> str:
    parts = list(p.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


mods = {modname(p): ast.parse(p.read_text()) for p in sorted((root / PKG).rglob("*.py"))}


def imports_of(nodes) -> dict[str, str]:
    out = {}
    for n in nodes:
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(PKG):
            for a in n.names:
                out[a.asname or a.name] = f"{n.module}.{a.name}"
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith(PKG) and a.asname:
                    out[a.asname] = a.name
    return out


defs: dict[str, tuple[str, ast.AST, str | None]] = {}
classes: dict[str, ast.ClassDef] = {}  # simple name -> class (the package's names are unique enough)
for m, tree in mods.items():
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[f"{m}.{n.name}"] = (m, n, None)
        elif isinstance(n, ast.ClassDef):
            defs[f"{m}.{n.name}"] = (m, n, None)
            classes.setdefault(n.name, n)
            for b in n.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs[f"{m}.{n.name}.{b.name}"] = (m, b, n.name)
mod_imports = {m: imports_of(t.body) for m, t in mods.items()}
class_module = {}
for q, (_m, n, _c) in defs.items():
    if isinstance(n, ast.ClassDef):
        class_module.setdefault(n.name, q)


def resolve(target: str, depth: int = 0) -> str | None:
    if target in defs:
        return target
    if depth > 6:
        return None
    mod, _, name = target.rpartition(".")
    if mod in mod_imports and name in mod_imports[mod]:
        return resolve(mod_imports[mod][name], depth + 1)
    return None


# ---- types: a type is ("C", name) for a class, ("T", [types]) for a tuple, None unknown
def ann(node):
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.Name):
        return ("C", node.id) if node.id in classes else None
    if isinstance(node, ast.Attribute):
        return ("C", node.attr) if node.attr in classes else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        return ann(node.left) or ann(node.right)
    if isinstance(node, ast.Subscript):
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        if base in ("tuple", "Tuple"):
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return ("T", [ann(e) for e in elts])
        if base == "Optional":
            return ann(node.slice)
    return None


def fields_of(cname: str) -> dict[str, object]:
    """A class's annotated fields and self.x = <param> assignments in __init__, with their types."""
    out = {}
    seen = set()
    stack = [cname]
    while stack:
        c = stack.pop()
        if c in seen or c not in classes:
            continue
        seen.add(c)
        cls = classes[c]
        for b in cls.body:
            if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                out.setdefault(b.target.id, ann(b.annotation))
            if isinstance(b, ast.FunctionDef) and b.name == "__init__":
                pt = {a.arg: ann(a.annotation) for a in b.args.args}
                for x in ast.walk(b):
                    if isinstance(x, ast.Assign) and len(x.targets) == 1:
                        t = x.targets[0]
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            if isinstance(x.value, ast.Name) and pt.get(x.value.id):
                                out.setdefault(t.attr, pt[x.value.id])
                    if isinstance(x, ast.AnnAssign) and isinstance(x.target, ast.Attribute):
                        out.setdefault(x.target.attr, ann(x.annotation))
        stack += [getattr(bs, "id", getattr(bs, "attr", "")) for bs in cls.bases]
    return out


def ordered_fields(cname: str) -> list[str]:
    cls = classes[cname]
    return [b.target.id for b in cls.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]


def is_settings(t) -> bool:
    return t is not None and t[0] == "C" and t[1] in TYPES


class Fn:
    def __init__(self, qual: str, given: dict[str, object]):
        self.qual = qual
        self.m, self.node, self.cls = defs[qual]
        self.imports = dict(mod_imports[self.m])
        self.imports.update(imports_of(ast.walk(self.node)))
        self.env: dict[str, object] = {}
        for a in self.node.args.posonlyargs + self.node.args.args + self.node.args.kwonlyargs:
            self.env[a.arg] = ann(a.annotation) or given.get(a.arg)
        if self.cls:
            self.env["self"] = ("C", self.cls)
        for a, t in given.items():
            if t is not None:
                self.env[a] = t
        # assignments, in source order (good enough: one pass, twice)
        for _ in range(2):
            for x in ast.walk(self.node):
                if isinstance(x, (ast.Assign, ast.AnnAssign)):
                    targets = x.targets if isinstance(x, ast.Assign) else [x.target]
                    t = ann(x.annotation) if isinstance(x, ast.AnnAssign) else None
                    t = t or (self.type_of(x.value) if x.value is not None else None)
                    for tg in targets:
                        self.bind(tg, t)

    def bind(self, tg, t):
        if isinstance(tg, ast.Name):
            if t is not None:
                self.env[tg.id] = t
        elif isinstance(tg, ast.Tuple):
            parts = None
            if t is not None and t[0] == "T":
                parts = t[1]
            elif t is not None and t[0] == "C" and t[1] in classes:
                fs = fields_of(t[1])
                parts = [fs.get(f) for f in ordered_fields(t[1])]
            for i, e in enumerate(tg.elts):
                if parts is not None and i < len(parts):
                    self.bind(e, parts[i])

    def callee(self, f) -> str | None:
        if isinstance(f, ast.Name):
            q = f"{self.m}.{f.id}"
            return (
                resolve(q) if q in defs else (resolve(self.imports[f.id]) if f.id in self.imports else None)
            )
        if isinstance(f, ast.Attribute):
            base = f.value
            if isinstance(base, ast.Name) and base.id in self.imports and base.id not in self.env:
                return resolve(self.imports[base.id] + "." + f.attr)
            bt = self.type_of(base)
            if bt is not None and bt[0] == "C" and bt[1] in class_module:
                return resolve(f"{class_module[bt[1]]}.{f.attr}")
        return None

    def type_of(self, e):
        if isinstance(e, ast.Tuple):
            return ("T", [self.type_of(x) for x in e.elts])
        if isinstance(e, ast.Name):
            return self.env.get(e.id)
        if isinstance(e, ast.Attribute):
            bt = self.type_of(e.value)
            if bt is not None and bt[0] == "C":
                return fields_of(bt[1]).get(e.attr)
            return None
        if isinstance(e, ast.Call):
            f = e.func
            if (isinstance(f, ast.Attribute) and f.attr == "replace") or (
                isinstance(f, ast.Name) and f.id == "replace"
            ):
                return self.type_of(e.args[0]) if e.args else None
            q = self.callee(f)
            if q is None:
                return None
            _, n, _ = defs[q]
            if isinstance(n, ast.ClassDef):
                return ("C", n.name)
            return ann(n.returns)
        return None

    def carries(self, e) -> bool:
        if isinstance(e, ast.Starred):
            e = e.value
        if is_settings(self.type_of(e)):
            return True
        if VALUES and isinstance(e, ast.Attribute):
            x = e
            while isinstance(x, ast.Attribute):
                if is_settings(self.type_of(x.value)):
                    return True
                x = x.value
        return False


stops: set[str] = set()
work: list[tuple[str, dict]] = [(ENTRY, {_PNAME: ("C", _PTYPE)})]
seen: set = set()
via: dict = {}


def param_names(node, method: bool):
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    return (names[1:] if method and names and names[0] in ("self", "cls") else names), [
        x.arg for x in a.posonlyargs + a.args + a.kwonlyargs
    ]


def holders(cname: str) -> set[str]:
    return {f for f, t in fields_of(cname).items() if is_settings(t)}


while work:
    qual, given = work.pop()
    key = (qual, tuple(sorted((k, str(v)) for k, v in given.items())))
    if key in seen:
        continue
    seen.add(key)
    stops.add(qual)
    fn = Fn(qual, given)
    for n in ast.walk(fn.node):
        if not isinstance(n, ast.Call):
            continue
        q = fn.callee(n.func)
        if q is None:
            continue
        cm, cnode, ccls = defs[q]
        on_holder = False
        if (
            isinstance(n.func, ast.Attribute) and ccls is not None
        ):  # a method called on an object holding settings
            bt = fn.type_of(n.func.value)
            on_holder = bt is not None and bt[0] == "C" and (is_settings(bt) or bool(holders(bt[1])))
        if isinstance(cnode, ast.ClassDef):
            init = defs.get(f"{q}.__init__")
            names, kws = param_names(init[1], True) if init else (ordered_fields(cnode.name),) * 2
        else:
            names, kws = param_names(cnode, ccls is not None)
        got = {}
        for i, a in enumerate(n.args):
            if i < len(names) and fn.carries(a):
                got[names[i]] = fn.type_of(a)
        for k in n.keywords:
            if k.arg in kws and fn.carries(k.value):
                got[k.arg] = fn.type_of(k.value)
        if not got and not on_holder:
            continue
        via.setdefault(q, f"{qual.removeprefix('peagle_pipeline.')}:{n.lineno}")
        if isinstance(cnode, ast.ClassDef):
            stops.add(q)
            if init:
                work.append((f"{q}.__init__", got))
            fields = set(got) | holders(cnode.name)
            for b in cnode.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and b.name != "__init__":
                    reads = {
                        x.attr
                        for x in ast.walk(b)
                        if isinstance(x, ast.Attribute)
                        and isinstance(x.value, ast.Name)
                        and x.value.id == "self"
                    }
                    if reads & fields:
                        work.append((f"{q}.{b.name}", {}))
        else:
            work.append((q, got))

byfile = defaultdict(list)
for s in stops:
    byfile[defs[s][0]].append(s)
print(
    f"{'values' if VALUES else 'objects'} [{','.join(sorted(TYPES))}]: {len(stops)} stops in {len(byfile)} files"
)
if ARGS.list:
    for f in sorted(byfile):
        print(
            f"  {f}: {len(byfile[f])}  "
            + ", ".join(
                sorted(
                    x.removeprefix(f + ".") + ("<-" + via[x] if ARGS.via and x in via else "")
                    for x in byfile[f]
                )
            )
        )
