"""Preemption loops: SIGTERM (as SLURM and Kubernetes send it) and SIGINT (Ctrl-C), alternating, sent to the whole
process group of a real `extract`, `generate` and `train` at random moments after a new commit; each stop must
exit within seconds with one error line and its code (143 / 130), and re-running the same command after every
stop must end with exactly the result of an uninterrupted run (cache bytes, rows file bytes, weights and losses).

STOPS (PEAGLE_PREEMPT_STOPS, default 2: one SIGTERM, one SIGINT) stops per stage; moments seeded by
PEAGLE_CRASH_SEED. Markers: crash, slow.
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
from cli_argv import PEAGLE, small_train_flags, start_cli
from cli_run import run_cli
from safetensors.torch import load_file

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.data.onpolicy_files import SLEEP_ENV, rejects_file, rows_file, state_file
from peagle_pipeline.stages.train import metrics

pytestmark = [pytest.mark.crash, pytest.mark.slow]

STOPS = int(os.environ.get("PEAGLE_PREEMPT_STOPS", "2"))
SEED = int(os.environ.get("PEAGLE_CRASH_SEED", "2026"))
EXIT_WITHIN_S = 15.0  # generous for a loaded 2-core host; a stop takes well under a second here
SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXPECTED = {signal.SIGTERM: (143, "error: terminated (SIGTERM)"), signal.SIGINT: (130, "error: interrupted")}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)
    env.pop("PEAGLE_DEBUG", None)
    return env


def _stop_when(
    cmd: list[str],
    env: dict[str, str],
    ready: Callable[[], bool],
    delay: float,
    sig: int,
    workers: bool = False,
) -> str | None:
    """Start `cmd`; once `ready()` holds and `delay` s more have passed, send `sig` to its process group.

    A command without `workers` (processes of its own below it) runs through the fork server, whose client passes
    the signal on to it; one with workers starts fresh, so that they get the signal from the group as well.
    Returns the stop's one error line, or None when the command finished first (exit 0). Asserts the exit code,
    the single line without traceback and the exit within EXIT_WITHIN_S of the signal."""
    popen: dict = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc = subprocess.Popen(cmd, env=env, **popen) if workers else start_cli(cmd, env, **popen)
    deadline = time.monotonic() + 240
    while not ready():
        if proc.poll() is not None:
            break
        assert time.monotonic() < deadline, "timed out waiting for the stop point"
        time.sleep(0.01)
    time.sleep(delay)
    if proc.poll() is not None:
        err = proc.stderr.read()
        assert proc.returncode == 0, err[-2000:]
        return None
    sent = time.monotonic()
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    code, start = EXPECTED[sig]
    lines = [
        line for line in err.splitlines() if line.strip() and not line.startswith(("SIGINT:", "SIGTERM:"))
    ]
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and sum(line.startswith("error:") for line in lines) == 1, err[-2000:]
    assert lines[-1].startswith(start) and "re-run" in lines[-1], lines[-1]
    assert took < EXIT_WITHIN_S, f"{signal.Signals(sig).name} took {took:.1f} s to stop"
    return lines[-1]


# ------------------------------------------------------------------------------------------------- extract
EXTRACT_FLAGS = ["--dtype", "fp32", "--max-length", "200", "--shard-tokens", "256", "--chunk-tokens", "64"]


def _extract_cmd(model: Path, data: Path, out: Path) -> list[str]:
    return [
        *PEAGLE,
        "extract",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(out),
        *EXTRACT_FLAGS,
    ]


def _manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / layout.STORES_DIR / layout.store_name(0, 1) / layout.MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _store_bytes(root: Path) -> dict[str, bytes]:
    """Every file of every store but the manifest (which counts commits) and the writer's lock file."""
    stores = root / layout.STORES_DIR
    return {
        str(p.relative_to(stores)): p.read_bytes()
        for p in sorted(stores.rglob("*"))
        if p.is_file() and p.name != layout.MANIFEST and not p.name.endswith(".lock")
    }


def test_extract_stops_on_sigterm_and_sigint_and_resumes_to_the_same_bytes(
    tiny_model: Path, conversations: Path, tmp_path: Path
) -> None:
    ref, out = tmp_path / "ref", tmp_path / "out"
    done = run_cli(_extract_cmd(tiny_model, conversations, ref), _env())
    assert done.returncode == 0, done.stderr[-2000:]
    rng, stops = random.Random(SEED), 0
    for i in range(STOPS):
        commits = (_manifest(out) or {}).get("commits", 0)

        def ready(c: int = commits) -> bool:
            return (_manifest(out) or {}).get("commits", 0) > c

        env = _env(
            PEAGLE_TEST_COMMIT_SLEEP="0.2"
        )  # stops also land inside a commit (held until it is written)
        line = _stop_when(
            _extract_cmd(tiny_model, conversations, out), env, ready, rng.uniform(0, 0.3), SIGNALS[i % 2]
        )
        if line is None:
            break
        stops += 1
        man = _manifest(out)
        assert man is not None and not man["complete"]
        assert f": {man['committed_samples']} samples of {layout.store_name(0, 1)} are committed" in line, (
            line
        )
    final = run_cli(_extract_cmd(tiny_model, conversations, out), _env())
    assert final.returncode == 0, final.stderr[-2000:]
    assert stops >= 2, f"only {stops} stops landed before the extraction finished"
    assert_same_cache(ref, out)
    assert _store_bytes(ref) == _store_bytes(out)
    assert verify_cache(open_cache(out)) == []


# ------------------------------------------------------------------------------------------------ generate
GENERATE_FLAGS = [
    *("--backend", "hf", "--compute-dtype", "fp32", "--device", "cpu", "--temperature", "1.0"),
    *("--max-new-tokens", "16", "--max-samples", "16", "--chunk-size", "2", "--batch-size", "2"),
]


def _generate_cmd(model: Path, data: Path, out: Path) -> list[str]:
    return [
        *PEAGLE,
        "generate",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(out),
        *GENERATE_FLAGS,
    ]


def _state(out: Path) -> dict:
    try:
        return json.loads((out / state_file(0, 1)).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_generate_stops_on_sigterm_and_sigint_and_resumes_to_the_same_bytes(
    tiny_stop_model: Path, conversations: Path, tmp_path: Path
) -> None:
    ref, out = tmp_path / "ref", tmp_path / "out"
    done = run_cli(_generate_cmd(tiny_stop_model, conversations, ref), _env())
    assert done.returncode == 0, done.stderr[-2000:]
    rng, stops = random.Random(SEED + 2), 0
    for i in range(STOPS):
        chunks = _state(out).get("chunks", 0)

        def ready(c: int = chunks) -> bool:
            return _state(out).get("chunks", 0) > c

        env = _env(**{SLEEP_ENV: "0.3"})  # some stops land between a chunk's rows and its state update
        line = _stop_when(
            _generate_cmd(tiny_stop_model, conversations, out),
            env,
            ready,
            rng.uniform(0, 0.5),
            SIGNALS[i % 2],
        )
        if line is None:
            break
        stops += 1
        st = _state(out)
        assert not st["complete"] and f": {st['rows']} rows of {rows_file(0, 1)} are committed" in line, line
    final = run_cli(_generate_cmd(tiny_stop_model, conversations, out), _env())
    assert final.returncode == 0, final.stderr[-2000:]
    assert stops >= 2, f"only {stops} stops landed before generation finished"
    for name in (rows_file(0, 1), rejects_file(0, 1), state_file(0, 1)):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


# --------------------------------------------------------------------------------------------------- train
STEPS = 400  # a tiny step takes ~10 ms: enough steps that every stop lands inside the loop
TRAIN_FLAGS = small_train_flags(
    depths=3, tokens_per_step=160, steps=STEPS, eval_every=100, save_every=1000, num_workers=1
)


def _train_cmd(cache: Path, out: Path, *extra: str) -> list[str]:
    return [*PEAGLE, "train", "--cache", str(cache), "--output", str(out), *TRAIN_FLAGS, *extra]


def _last_step(out: Path) -> int:
    steps = [r["step"] for r in metrics.read_metrics(out) if r.get("kind") == "train"] if out.exists() else []
    return steps[-1] if steps else 0


def test_train_stops_on_sigterm_and_sigint_saves_and_resumes_exactly(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """save_every is past the end: every checkpoint but the last is written by a stop (a DataLoader worker runs and
    gets the signal too, as under SLURM, and must not break the stop)."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    done = run_cli(_train_cmd(tiny_cache, ref), _env())
    assert done.returncode == 0, done.stderr[-2000:]
    rng, stops = random.Random(SEED + 3), 0
    for i in range(STOPS):
        last = _last_step(out)
        cmd = _train_cmd(tiny_cache, out, *(["--resume"] if (out / "train.yaml").exists() else []))
        line = _stop_when(
            cmd,
            _env(),
            lambda s=last: _last_step(out) > s + 1,
            rng.uniform(0, 0.3),
            SIGNALS[i % 2],
            workers=True,
        )
        if line is None:
            break
        stops += 1
        stopped = int(line.split(" at step ")[1].split()[0])
        assert f"checkpoint step-{stopped} saved" in line and "--resume" in line, line
        assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:08d}"
    final = run_cli(_train_cmd(tiny_cache, out, "--resume"), _env())
    assert final.returncode == 0, final.stderr[-2000:]
    assert stops >= 2, f"only {stops} stops landed before training finished"
    name = f"step-{STEPS:08d}"
    wa = load_file(str(ref / "checkpoints" / name / "model.safetensors"))
    wb = load_file(str(out / "checkpoints" / name / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    la = [(r["step"], r["loss"]) for r in metrics.read_metrics(ref) if r["kind"] == "train"]
    lb = [(r["step"], r["loss"]) for r in metrics.read_metrics(out) if r["kind"] == "train"]
    assert la == lb and len(la) == STEPS
