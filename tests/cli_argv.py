"""Helpers for tests that run the real CLI as a subprocess (run to completion, Popen + kill -9, torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys

PEAGLE = [sys.executable, "-m", "peagle_pipeline.cli"]
"""`peagle-pipeline` run with this interpreter: PEAGLE + ["train", ...]."""


def extract_argv(model: object, data: object, out: object, *extra: str) -> list[str]:
    """`peagle-pipeline extract --model MODEL --data DATA --output OUT EXTRA...` with this interpreter."""
    return [*PEAGLE, "extract", "--model", str(model), "--data", str(data), "--output", str(out), *extra]


def train_argv(cache: object, out: object, *extra: str) -> list[str]:
    """`peagle-pipeline train --cache CACHE --output OUT EXTRA...` with this interpreter."""
    return [*PEAGLE, "train", "--cache", str(cache), "--output", str(out), *extra]


def flags(**options: object) -> list[str]:
    """CLI flags from keyword options, in order: depths=3 -> ["--depths", "3"]; True -> "--name",
    False -> "--no-name"; underscores become dashes."""
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def run_peagle(
    *args: str, env: dict[str, str] | None = None, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run `peagle-pipeline ARGS` to completion (OMP_NUM_THREADS=1 unless env sets it, PEAGLE_DEBUG unset);
    check: raise AssertionError with the stderr tail on a non-zero exit."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.pop("PEAGLE_DEBUG", None)
    proc = subprocess.run([*PEAGLE, *args], capture_output=True, text=True, env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"peagle-pipeline {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return proc


def small_train_flags(**overrides: object) -> list[str]:
    """Train flags of the tiny-cache runs of the crash tests (fp32, frequent checkpoints, no export)."""
    base: dict[str, object] = dict(
        save_every=3,
        eval_samples=4,
        precision="fp32",
        log_every=1,
        warmup=2,
        lr=2e-3,
        draft_vocab_size=300,
        export=False,
        keep_checkpoints=2,
    )
    return flags(**{**base, **overrides})
