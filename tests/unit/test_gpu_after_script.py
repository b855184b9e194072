"""`experiments/gpu_after.sh`: after a GPU run, the files of each results folder copied back are kept by folder, the
export's parts are joined and checked against the checksum the run wrote, and a part that is missing or damaged stops
it in one line (`EVAL=0`: the vLLM measurement, which needs .venv-vllm, is left out here)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PART = 1000  # bytes per export part here (PART_MIB, 15 MiB by default, on the GPU machine)


def _checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "experiments").mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "gpu_after.sh", repo / "experiments")
    return repo


def _calls(tmp_path: Path, weights: bytes) -> tuple[Path, Path]:
    """Two results folders copied back: the first four parts with config and checksum, then the rest with logs."""
    go1, go2 = tmp_path / "files" / "go1", tmp_path / "files" / "go2"
    parts = [weights[i : i + PART] for i in range(0, len(weights), PART)]
    assert len(parts) == 12  # parts 10 and 11: joined after part 9, not after part 1
    for d, names in ((go1, range(0, 4)), (go2, range(4, 12))):
        d.mkdir(parents=True)
        for i in names:
            (d / f"model.safetensors.part{i}").write_bytes(parts[i])
        (d / "logs.txt").write_text(f"{d.name} log\n")
    digest = hashlib.sha256(weights).hexdigest()
    (go1 / "sha256").write_text(f"{digest}  /tmp/gq/run/export/model.safetensors\n")
    (go1 / "config.json").write_text("{}\n")
    (go1 / ".peagle-export.json").write_text("{}\n")
    (go2 / "metrics.jsonl").write_text("{}\n")
    return go1, go2


def _after(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "experiments/gpu_after.sh", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EVAL": "0"},
    )


def test_the_parts_join_to_the_runs_checksum_and_each_calls_files_are_kept(tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    weights = random.Random(0).randbytes(12 * PART - 123)
    go1, go2 = _calls(tmp_path, weights)
    dest = repo / "bench/results/gpu-test"
    out = _after(repo, str(dest), f"go1={go1}", f"go2={go2}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (repo / ".gpu/export/model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (repo / ".gpu/export").iterdir()) == [
        ".peagle-export.json",
        "config.json",
        "model.safetensors",
        "sha256",
    ]
    # the results folder keeps every copied file by folder, and no weights
    assert (dest / "go1/logs.txt").read_text() == "go1 log\n" and (
        dest / "go2/logs.txt"
    ).read_text() == "go2 log\n"
    assert (dest / "go2/metrics.jsonl").is_file() and (dest / "go1/sha256").is_file()
    assert not list(dest.rglob("model.safetensors*"))
    assert "joined from 12 parts" in out.stdout


def test_a_missing_or_damaged_part_stops_in_one_line(tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    go1, go2 = _calls(tmp_path, random.Random(1).randbytes(12 * PART - 5))
    (go2 / "model.safetensors.part11").unlink()  # the last folder did not come back whole
    out = _after(repo, str(repo / "r"), f"go1={go1}", f"go2={go2}")
    assert out.returncode == 1
    errors = [line for line in out.stdout.splitlines() if "error" in line]
    assert len(errors) == 1 and "do not give the export's sha256" in errors[0], out.stdout

    part = go2 / "model.safetensors.part7"
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    assert _after(repo, str(repo / "r"), f"go1={go1}", f"go2={go2}").returncode == 1

    bare = tmp_path / "files" / "bare"  # config and checksum, no part at all
    bare.mkdir()
    for name in ("sha256", "config.json"):
        shutil.copy(go1 / name, bare)
    assert _after(repo, str(repo / "r"), f"go1={bare}").returncode == 1

    no_dir = _after(repo, str(repo / "r"), f"go1={tmp_path / 'nowhere'}")
    assert no_dir.returncode == 2 and "no folder" in no_dir.stdout
    assert _after(repo, str(repo / "r"), "go1").returncode == 2  # not NAME=DIR
