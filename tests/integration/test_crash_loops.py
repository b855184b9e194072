"""Crash loops: kill -9 a real extraction, then a real training run, at random moments (6 times each by default,
PEAGLE_CRASH_KILLS for more) and resume every time; the end result must be bit-identical to an uninterrupted run.

Kill moments are random (seed PEAGLE_CRASH_SEED) and include the dangerous windows, widened by the test hooks:
- extraction: PEAGLE_TEST_COMMIT_SLEEP makes the writer pause between a commit's shard data and its manifest;
  a kill in that window leaves shard bytes past the committed end (counted as "mid-commit" kills);
- training: PEAGLE_TEST_CKPT_SLEEP pauses between the files of a checkpoint write; a kill in that window leaves
  a `step-N.tmp/` directory (counted as "mid-checkpoint" kills).
Each loop prints the kills survived. Markers: crashloop, slow.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cache_compare import assert_same_cache
from cli_argv import end_of_killed_runs, extract_argv, small_train_flags, start_cli, train_argv
from cli_run import run_cli
from safetensors.torch import load_file

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.stages.train import metrics

pytestmark = [pytest.mark.crashloop, pytest.mark.slow]

KILLS = int(os.environ.get("PEAGLE_CRASH_KILLS", "6"))  # kill -9 per loop; more with PEAGLE_CRASH_KILLS
SEED = int(os.environ.get("PEAGLE_CRASH_SEED", "2026"))
EXTRACT_SETTINGS = [
    "--dtype",
    "fp32",
    "--max-length",
    "200",
    "--shard-tokens",
    "256",
    "--chunk-tokens",
    "64",
    "--batch-tokens",
    "512",
]
STEPS = 72  # 24 checkpoints, enough for 10 kills: margin when a loaded machine lets a run race ahead between kills
TRAIN_FLAGS = small_train_flags(depths=3, tokens_per_step=160, steps=STEPS, eval_every=12, num_workers=0)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)
    env.pop("PEAGLE_DEBUG", None)
    return env


def _kill_when(
    cmd: list[str], env: dict[str, str], ready: Callable[[], bool], extra_delay: float, timeout: float = 180
) -> bool:
    """Start `cmd` (through the fork server); once `ready()` holds, wait `extra_delay` s and kill -9 it.

    Returns False when the process finished on its own before the kill (nothing left to interrupt).
    """
    proc = start_cli(
        cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if proc.poll() is not None:
                assert proc.returncode == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
                return False
            assert time.monotonic() < deadline, "timed out waiting for the kill point"
            time.sleep(0.01)
        time.sleep(extra_delay)
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
            return False
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        end_of_killed_runs()
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return True


# ------------------------------------------------------------------------------------------------- extract
def _extract_cmd(model: Path, data: Path, out: Path) -> list[str]:
    return extract_argv(model, data, out, *EXTRACT_SETTINGS)


def _manifest(out: Path) -> dict | None:
    path = out / layout.STORES_DIR / layout.store_name(0, 1) / layout.MANIFEST
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _written_past_commit(out: Path) -> bool:
    """True when shard data beyond the committed end is on disk (a kill landed between data and manifest)."""
    man = _manifest(out)
    committed = man["committed_tokens"] if man else 0
    meta = out / layout.STORES_DIR / layout.store_name(0, 1) / "input_ids" / "zarr.json"
    return meta.exists() and json.loads(meta.read_text())["shape"][0] > committed


def test_extraction_survives_kill9_loop(tiny_model: Path, conversations: Path, tmp_path: Path) -> None:
    ref, out = tmp_path / "ref", tmp_path / "crashy"
    done = run_cli(_extract_cmd(tiny_model, conversations, ref), _env())
    assert done.returncode == 0, done.stderr[-2000:]
    rng = random.Random(SEED)
    kills, mid_commit, t0 = 0, 0, time.monotonic()
    while kills < KILLS:
        man = _manifest(out)
        assert not (man and man["complete"]), f"extraction completed after only {kills} kills"
        commits = man["commits"] if man else 0
        if kills == 0:  # during start-up, before anything is committed
            ready, delay = (lambda: (out / layout.CACHE_META).exists()), rng.uniform(0.0, 1.0)
        else:  # after at least one new commit, at a random moment (often inside the next commit's window)

            def ready(c: int = commits) -> bool:
                m = _manifest(out)
                return m is not None and m["commits"] > c

            delay = rng.uniform(0.0, 0.5)
        env = _env(PEAGLE_TEST_COMMIT_SLEEP="0.25")
        if not _kill_when(_extract_cmd(tiny_model, conversations, out), env, ready, delay):
            break
        kills += 1
        mid_commit += _written_past_commit(out)
    final = run_cli(_extract_cmd(tiny_model, conversations, out), _env())
    assert final.returncode == 0, final.stderr[-2000:]
    assert_same_cache(ref, out)
    assert verify_cache(open_cache(out)) == []
    print(
        f"\ncrash loop (extract): survived {kills} kill -9 ({mid_commit} between shard data and manifest) "
        f"in {time.monotonic() - t0:.0f} s; resumed cache bit-identical"
    )
    assert kills >= KILLS and mid_commit >= 1


def _store_files(root: Path) -> dict[str, bytes]:
    """Every file of every store but the manifest (which counts commits) and the writer's lock file."""
    stores = root / layout.STORES_DIR
    return {
        str(p.relative_to(stores)): p.read_bytes()
        for p in sorted(stores.rglob("*"))
        if p.is_file() and p.name != layout.MANIFEST and not p.name.endswith(".lock")
    }


def test_an_extraction_resumed_after_kill9_writes_the_same_shard_files(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Long prompts and short replies: many loss_mask chunks are all False (Zarr's "empty" chunks). The resumed
    writer stores them exactly as the uninterrupted one does, so every store file is byte-identical."""
    data = tmp_path / "long-prompts.jsonl"
    words = "hello world the quick brown fox jumps over lazy dog".split()
    with data.open("w") as f:
        for i in range(16):
            ask = " ".join(words[(i + j) % len(words)] for j in range(60))
            turns = [{"role": "user", "content": ask}, {"role": "assistant", "content": " ".join(words[:5])}]
            f.write(json.dumps({"messages": turns}) + "\n")
    ref, out = tmp_path / "ref", tmp_path / "resumed"
    done = run_cli(_extract_cmd(tiny_model, data, ref), _env())
    assert done.returncode == 0, done.stderr[-2000:]
    empty = [p for p in (ref / layout.STORES_DIR).rglob("loss_mask/c/*") if p.is_file()]
    assert empty, "no loss_mask shard written"

    def committed() -> bool:
        m = _manifest(out)
        return m is not None and m["commits"] >= 1

    assert _kill_when(_extract_cmd(tiny_model, data, out), _env(PEAGLE_TEST_COMMIT_SLEEP="0.3"), committed, 0)
    man = _manifest(out)
    assert man is not None and not man["complete"]
    final = run_cli(_extract_cmd(tiny_model, data, out), _env())
    assert final.returncode == 0, final.stderr[-2000:]
    assert_same_cache(ref, out)
    a, b = _store_files(ref), _store_files(out)
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []


# --------------------------------------------------------------------------------------------------- train
def _train_cmd(cache: Path, out: Path, *extra: str) -> list[str]:
    return train_argv(cache, out, *TRAIN_FLAGS, *extra)


def _steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    if not root.exists():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.is_dir() and p.name[5:].isdigit())


def _tmp_dirs(out: Path) -> list[str]:
    root = out / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp")) if root.exists() else []


def test_training_survives_kill9_loop(tiny_cache: Path, tmp_path: Path) -> None:
    ref, out = tmp_path / "ref", tmp_path / "run"
    done = run_cli(_train_cmd(tiny_cache, ref), _env())
    assert done.returncode == 0, done.stderr[-2000:]
    rng = random.Random(SEED + 1)
    kills, mid_ckpt, t0 = 0, 0, time.monotonic()
    while kills < KILLS:
        last = _steps(out)[-1] if _steps(out) else 0
        assert last < STEPS, f"training completed after only {kills} kills"
        cmd = _train_cmd(tiny_cache, out, *(["--resume"] if (out / "train.yaml").exists() else []))
        if kills % 2:  # inside a checkpoint write newer than the last complete one

            def ready(s: int = last) -> bool:
                return any(int(name[5:13]) > s for name in _tmp_dirs(out))

            env, delay = _env(PEAGLE_TEST_CKPT_SLEEP="0.3"), rng.uniform(0.0, 0.25)
        else:  # after a new complete checkpoint, at a random moment of the following steps

            def ready(s: int = last) -> bool:
                steps = _steps(out)
                return bool(steps) and steps[-1] > s

            env, delay = _env(), rng.uniform(0.0, 0.4)
        if not _kill_when(cmd, env, ready, delay):
            break
        kills += 1
        mid_ckpt += bool(_tmp_dirs(out))
    final = run_cli(_train_cmd(tiny_cache, out, "--resume"), _env())
    assert final.returncode == 0, final.stderr[-2000:]
    assert not _tmp_dirs(out)
    name = f"step-{STEPS:08d}"
    wa = load_file(str(ref / "checkpoints" / name / "model.safetensors"))
    wb = load_file(str(out / "checkpoints" / name / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    la = [(r["step"], r["loss"]) for r in metrics.read_metrics(ref) if r["kind"] == "train"]
    lb = [(r["step"], r["loss"]) for r in metrics.read_metrics(out) if r["kind"] == "train"]
    assert la == lb and len(la) == STEPS
    print(
        f"\ncrash loop (train): survived {kills} kill -9 ({mid_ckpt} inside a checkpoint write) in "
        f"{time.monotonic() - t0:.0f} s; final weights and per-step losses bit-identical"
    )
    assert kills >= KILLS and mid_ckpt >= 1
