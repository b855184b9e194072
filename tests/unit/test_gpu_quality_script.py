"""`experiments/gpu_quality.sh`: `pack-gguf` / `unpack-gguf`, the target's GGUF xz-packed into parts no larger than
PART_MIB and rebuilt and checked on the GPU machine; `go` after a finished run, the export split into parts no larger
than PART_MIB in the results folder with its checksum, config and logs. Run on a scratch checkout holding the script,
so that a part over the limit or a damaged copy is caught here, before a GPU run."""

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
    return repo


def _script(repo: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "experiments/gpu_quality.sh", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_the_packed_gguf_is_cut_into_parts_under_the_limit_and_rebuilds_to_its_checksum(
    tmp_path: Path,
) -> None:
    repo = _checkout(tmp_path)
    # a stand-in for the GGUF: random bytes (xz cannot shrink them) and repeated text (it can)
    rng = random.Random(0)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(rng.randbytes(2_500_000) + b"tokenizer.ggml.tokens " * 70_000)
    (repo / ".gpu").mkdir()
    (repo / ".gpu/gguf.xz.part9").write_bytes(b"stale")  # an older pack's part: replaced, not joined
    (repo / ".gpu/prompts.jsonl.xz").write_bytes(b"kept")  # the data beside it stays

    packed = _script(repo, "pack-gguf", str(gguf), env={"PART_MIB": "1"})
    assert packed.returncode == 0, packed.stdout + packed.stderr
    parts = sorted((repo / ".gpu").glob("gguf.xz.part*"))
    assert [p.name for p in parts] == ["gguf.xz.part000", "gguf.xz.part001", "gguf.xz.part002"]
    assert all(p.stat().st_size <= MIB for p in parts)
    assert sum(p.stat().st_size for p in parts) < gguf.stat().st_size
    assert (repo / ".gpu/prompts.jsonl.xz").read_bytes() == b"kept"

    # on the GPU machine: stage-a's copy of .gpu/ lands in the work directory; the GGUF is rebuilt and checked
    work = tmp_path / "work"
    work.mkdir()
    for f in (repo / ".gpu").iterdir():
        shutil.copy(f, work)
    rebuilt = _script(repo, "unpack-gguf", env={"WORK": str(work)})
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    assert (
        hashlib.sha256((work / "model.gguf").read_bytes()).digest()
        == hashlib.sha256(gguf.read_bytes()).digest()
    )

    # a part that lost its last byte on the way is refused in one line, before any stage uses the model
    last = work / "gguf.xz.part002"
    last.write_bytes(last.read_bytes()[:-1])
    damaged = _script(repo, "unpack-gguf", env={"WORK": str(work)})
    assert damaged.returncode == 1
    assert "GGUF damaged" in damaged.stdout


def test_go_after_the_run_puts_the_export_in_parts_under_the_limit_into_the_results(tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    work, out = tmp_path / "work", tmp_path / "out"
    export = work / "run" / "export"
    export.mkdir(parents=True)
    weights = random.Random(1).randbytes(2 * MIB + 12345)
    (export / "model.safetensors").write_bytes(weights)
    (export / "config.json").write_text("{}\n")
    (export / ".peagle-export.json").write_text("{}\n")
    (work / "run" / "train.yaml").write_text("depths: 4\n")
    (work / "log").write_text("[gpu-quality 06:25:31] model\n[gpu-quality 06:32:48] done\n")
    (work / "times.txt").write_text("start 1\ntrained 2\n")

    done = _script(repo, "go", "1", env={"WORK": str(work), "OUT": str(out), "PART_MIB": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    parts = sorted(out.glob("model.safetensors.part*"))
    assert len(parts) == 3 and all(p.stat().st_size <= MIB for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == weights
    digest = (out / "sha256").read_text().split()[0]
    assert digest == hashlib.sha256(weights).hexdigest()
    assert (out / "config.json").is_file() and (out / ".peagle-export.json").is_file()
    assert (out / "train.yaml").is_file() and "done" in (out / "logs.txt").read_text()

    # a run that ended without an export says so in one line and fails
    (export / "model.safetensors").unlink()
    missing = _script(repo, "go", "1", env={"WORK": str(work), "OUT": str(out)})
    assert missing.returncode == 1
    errors = [line for line in missing.stdout.splitlines() if "error" in line]
    assert len(errors) == 1 and "no export" in errors[0], missing.stdout
