"""`experiments/gpu_quality.sh carry`: each device call's carry plus the working tree the device tool copies with it,
against the 64 MiB a call may carry (docs/results/gpu-runs.md); `pack-gguf` / `unpack-gguf`: the target's GGUF
xz-packed and cut between the two calls that carry it, and rebuilt and checked there. Run on a scratch git checkout
holding the script and sparse files of chosen sizes, so an over-size carry is caught here and not by a refused call on
a lent GPU."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "experiments").mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "gpu_quality.sh", repo / "experiments")
    (repo / ".gitignore").write_text(".gpu/\n.whl/\n.whl-speculators/\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    return repo


def _sized(path: Path, mib: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        os.truncate(f.fileno(), int(mib * MIB))  # sparse: sizes without the bytes


def _script(repo: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "experiments/gpu_quality.sh", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )


def _carry(repo: Path) -> subprocess.CompletedProcess[str]:
    return _script(repo, "carry")


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_carry_within_64_mib_passes_and_one_over_it_fails(tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    _sized(repo / ".gpu/a/gguf.xz.part0", 44)
    _sized(repo / ".whl/wheels.whl", 15)
    _sized(repo / ".gpu/b/gguf.xz.part1", 58)
    _sized(repo / ".whl-speculators/s.whl", 23)
    ok = _carry(repo)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for call in ("stage-a", "go", "gpu_profile.sh"):
        assert f"{call} carries" in ok.stdout
    assert "over 64 MiB" not in ok.stdout

    # 5.5 MiB more of files in the working tree (untracked, not ignored: the device tool copies them too) put
    # stage-a's 59 MiB of carry over the limit, and only stage-a's: go's 58 MiB stay under it
    _sized(repo / "bench/results/raw.jsonl", 5.5)
    over = _carry(repo)
    assert over.returncode == 1
    assert "stage-a's carry is over 64 MiB" in over.stdout
    assert "go's carry" not in over.stdout and "gpu_profile.sh's carry" not in over.stdout


def test_the_packed_gguf_is_cut_to_equal_carries_and_rebuilds_to_its_checksum(tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    # a stand-in for the GGUF: half random bytes, half repeated text (xz shrinks only the second)
    rng = random.Random(0)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(rng.randbytes(1_500_000) + b"tokenizer.ggml.tokens " * 70_000)
    _sized(repo / ".whl/wheels.whl", 1.0)
    _sized(repo / ".gpu/b/prompts.jsonl.xz", 0.25)
    (repo / ".gpu/a").mkdir(parents=True)
    (repo / ".gpu/a/gguf.part0").write_bytes(b"stale")  # an older layout's part: replaced, not carried twice

    packed = _script(repo, "pack-gguf", str(gguf))
    assert packed.returncode == 0, packed.stdout + packed.stderr
    assert sorted(p.name for p in (repo / ".gpu/a").iterdir()) == ["gguf.sha256", "gguf.xz.part0"]
    part0, part1 = repo / ".gpu/a/gguf.xz.part0", repo / ".gpu/b/gguf.xz.part1"
    assert part0.stat().st_size + part1.stat().st_size < gguf.stat().st_size * 0.6
    stage_a = _tree_bytes(repo / ".gpu/a") + _tree_bytes(repo / ".whl")
    go = _tree_bytes(repo / ".gpu/b")
    # equal but for the checksum file and the directories' entries
    assert abs(stage_a - go) < 16 << 10, (stage_a, go)

    # there: stage-a's and go's copies land in one work directory, the GGUF is rebuilt from them and checked
    work = tmp_path / "work"
    work.mkdir()
    for part in (*(repo / ".gpu/a").iterdir(), part1):
        shutil.copy(part, work)
    rebuilt = _script(repo, "unpack-gguf", env={"WORK": str(work)})
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    digest = hashlib.sha256((work / "model.gguf").read_bytes()).hexdigest()
    assert digest == hashlib.sha256(gguf.read_bytes()).hexdigest()

    # a part that lost its last byte on the way is refused in one line, before any stage uses the model
    (work / "gguf.xz.part1").write_bytes(part1.read_bytes()[:-1])
    damaged = _script(repo, "unpack-gguf", env={"WORK": str(work)})
    assert damaged.returncode == 1
    assert "GGUF damaged" in damaged.stdout
