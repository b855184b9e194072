"""`experiments/gpu_quality.sh carry`: each device call's carry plus the working tree the device tool copies with it,
against the 64 MiB a call may carry (docs/results/gpu-runs.md). Run on a scratch git checkout holding the script and
sparse files of chosen sizes, so an over-size carry is caught here and not by a refused call on a lent GPU."""

from __future__ import annotations

import os
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


def _carry(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "experiments/gpu_quality.sh", "carry"], cwd=repo, capture_output=True, text=True, timeout=60
    )


def test_a_carry_within_64_mib_passes_and_one_over_it_fails(tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    _sized(repo / ".gpu/a/gguf.part0", 44)
    _sized(repo / ".whl/wheels.whl", 15)
    _sized(repo / ".gpu/b/gguf.part1", 58)
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
