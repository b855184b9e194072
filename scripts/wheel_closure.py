"""Helpers of scripts/gpu_wheels.sh (standard library only: runs on any python3 that has pip).

wheel_closure.py requires WHEEL [--drop a,b]   the wheel's unconditional requirements (extras left out), one a
                                               line, without the names in --drop
wheel_closure.py stub NAME VERSION DIR         write an empty wheel NAME-VERSION-py3-none-any.whl into DIR and
                                               print its path: the resolver then takes the GPU machine's torch
                                               as given instead of fetching CUDA torch and its dependencies
wheel_closure.py carry REPORT [--minus FILE]   name==version of what a `pip install --report` installs, less
                                               the names required in FILE (a requirements file) and torch
                                               with its CUDA stack
wheel_closure.py missing FILE                  the name==version lines of FILE whose distribution this
                                               python has not installed (in any version)
wheel_closure.py missing-wheels DIR... [--skip a,b]
                                               the wheels in DIRs whose distribution this python has not
                                               installed (in any version): what `pip install --no-deps` may add
                                               without replacing a version the machine's packages rely on
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import json
import re
import sys
import zipfile
from pathlib import Path

# On the GPU machine already (its CUDA torch) or never to be carried (docs/guides/gpus.md).
MACHINE = ("torch", "torchvision", "torchaudio", "triton", "nvidia-", "cuda-")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires(wheel: str, drop: set[str]) -> list[str]:
    """`Requires-Dist` lines of `wheel` that no extra conditions, less the names in `drop`."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if re.search(r"\bextra\s*==", req):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", req)
        if name and canonical(name.group(0)) not in drop:
            out.append(req)
    return out


def stub(name: str, version: str, folder: str) -> Path:
    """An installable wheel of `name`==`version` that holds nothing and needs nothing."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: wheel_closure\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, body in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(body.encode())}")
    record.append(f"{info}/RECORD,,")
    out = Path(folder) / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, body in files.items():
            z.writestr(path, body)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return out


def installs(report: str) -> dict[str, str]:
    """{canonical name: version} of a `pip install --report` file."""
    data = json.loads(Path(report).read_text())
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}


def carry(report: str, minus: str | None) -> list[str]:
    have = set()
    for line in Path(minus).read_text().splitlines() if minus else []:
        name = re.match(r"\s*([A-Za-z0-9._-]+)", line)
        if name:
            have.add(canonical(name.group(1)))
    return sorted(
        f"{name}=={version}"
        for name, version in installs(report).items()
        if name not in have and not name.startswith(MACHINE)
    )


def missing(path: str) -> list[str]:
    """Lines `name==version` of `path` whose distribution is not installed here."""
    out = []
    for line in Path(path).read_text().split():
        try:
            importlib.metadata.version(line.split("==")[0])
        except importlib.metadata.PackageNotFoundError:
            out.append(line)
    return out


def missing_wheels(folders: list[str], skip: set[str]) -> list[str]:
    """Paths of the wheels in `folders` whose distribution is not installed here (names in `skip` left out)."""
    out = []
    for folder in folders:
        for wheel in sorted(Path(folder).glob("*.whl")):
            name = canonical(wheel.name.split("-")[0])
            if name in skip:
                continue
            try:
                importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                out.append(str(wheel))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("requires")
    r.add_argument("wheel")
    r.add_argument("--drop", default="")
    s = sub.add_parser("stub")
    s.add_argument("name")
    s.add_argument("version")
    s.add_argument("folder")
    c = sub.add_parser("carry")
    c.add_argument("report")
    c.add_argument("--minus")
    m = sub.add_parser("missing")
    m.add_argument("file")
    w = sub.add_parser("missing-wheels")
    w.add_argument("folders", nargs="+")
    w.add_argument("--skip", default="")
    a = ap.parse_args()
    if a.cmd == "requires":
        lines = requires(a.wheel, {canonical(n) for n in a.drop.split(",") if n})
    elif a.cmd == "stub":
        lines = [str(stub(a.name, a.version, a.folder))]
    elif a.cmd == "carry":
        lines = carry(a.report, a.minus)
    elif a.cmd == "missing":
        lines = missing(a.file)
    else:
        lines = missing_wheels(a.folders, {canonical(n) for n in a.skip.split(",") if n})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
