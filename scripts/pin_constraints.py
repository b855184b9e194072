"""Write constraints/cpu.txt: the exact versions this environment holds of everything
`pip install -e ".[dev,test-s3,test-trackers]"` pulls in (the closure of pyproject's requirements, markers evaluated
here). `make setup` installs with `-c constraints/cpu.txt`, so `make test` stays reproducible while pyproject.toml
declares ranges.

    .venv/bin/python scripts/pin_constraints.py [--extras dev,test-s3,test-trackers] [--out constraints/cpu.txt]
        [--check]

--check exits 1 when the file differs from what this environment would write (run it after changing
dependencies or upgrading the venv on purpose).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# Exact versions for this project's CPU machines (Python {py}, x86-64 Linux), used as `pip install -c` by
# `make setup`; pyproject.toml declares the ranges a user's environment may satisfy instead.
# torch {torch} is the local CPU wheel (pip's find-links); the GPU machines run torch 2.11 (see docs/guides/gpus.md).
# Regenerate with `.venv/bin/python scripts/pin_constraints.py` after an intended upgrade.
"""


def closure(requirements: list[str], extras: set[str]) -> dict[str, str]:
    """{canonical name: installed version} of `requirements` and everything they need, per installed metadata.

    Raises:
        SystemExit: a required distribution is not installed here.
    """
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, active = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (active or {""})):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{req.name} is required but not installed in {sys.prefix}") from None
        found[name] = dist.version
        for sub in dist.requires or []:
            todo.append((Requirement(sub), set(req.extras)))
    return found


def render(pins: dict[str, str]) -> str:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    lines = [HEADER.format(py=py, torch=pins.get("torch", "?"))]
    lines += [f"{name}=={version}" for name, version in sorted(pins.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--extras",
        default="dev,test-s3,test-trackers",
        help="comma-separated extras of the package to include",
    )
    ap.add_argument("--out", default=str(ROOT / "constraints" / "cpu.txt"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {e for e in args.extras.split(",") if e}
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    text = render(closure(reqs, set()))
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is stale: run scripts/pin_constraints.py", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} ({text.count('==')} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
