"""The tests' fork server (tests/zygote.py): a CLI run through it is the run a fresh interpreter gives, and it ends
when its caller ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_argv import (
    PEAGLE,
    descendants,
    end_of_killed_runs,
    extract_argv,
    fast_cli,
    fork_server_allowed,
    fork_server_pids,
)

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.writer import SLEEP_ENV

pytestmark = pytest.mark.skipif(
    not fork_server_allowed(), reason="no fork server here (turned off, or a GPU machine)"
)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)
    env.pop("PEAGLE_DEBUG", None)
    return env


@pytest.mark.parametrize(
    "args",
    [
        ["--version"],
        ["train", "--help"],
        ["inspect", "/nonexistent/cache"],
        ["train", "--cache", "c", "--output", "o", "--lr", "-1"],
        ["extract", "--no-such-flag"],
    ],
    ids=["version", "help", "not-a-cache", "bad-setting", "usage-error"],
)
def test_a_run_through_the_server_prints_and_exits_as_a_fresh_one(args: list[str], tmp_path: Path) -> None:
    env = _env()
    forked_argv = fast_cli([*PEAGLE, *args], env)
    assert forked_argv[:3] != PEAGLE  # it did go through the server
    fresh = subprocess.run(
        [*PEAGLE, *args], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    forked = subprocess.run(forked_argv, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def _start_slow_extraction(
    tiny_model: Path, conversations: Path, out: Path, sleep_s: float, first_commit: bool = True
) -> subprocess.Popen[str]:
    """An extraction through the server that sleeps `sleep_s` at each commit (between its data and its manifest);
    returned once its first commit, not its last, is on disk, or with `first_commit=False` once it has started
    the cache (it then writes, or sleeps in, its first commit)."""
    env = _env(**{SLEEP_ENV: str(sleep_s)})
    argv = extract_argv(tiny_model, conversations, out, "--dtype", "fp32", "--shard-tokens", "2048")
    client = subprocess.Popen(
        fast_cli([*argv, "--chunk-tokens", "256"], env),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (manifests := list((out / layout.STORES_DIR).glob(f"*/{layout.MANIFEST}"))):
        assert client.poll() is None, client.communicate()
        assert time.monotonic() < deadline, "no commit within 120 s"
        if not first_commit and (out / layout.CACHE_META).exists():
            return client
        time.sleep(0.05)
    assert not json.loads(manifests[0].read_text())["complete"]
    return client


def _forked_runs() -> set[int]:
    """Pids of the processes under this test process's fork servers."""
    return {child for server in fork_server_pids() for child in descendants(server)}


def test_the_run_dies_with_its_client(tiny_model: Path, conversations: Path, tmp_path: Path) -> None:
    """A test's timeout kills the client: the CLI child must not run on beside the next test."""
    client = _start_slow_extraction(tiny_model, conversations, tmp_path / "out", 30.0, first_commit=False)
    runs = _forked_runs()
    assert runs, "no CLI child under the fork server"
    client.kill()
    client.wait()
    # raises if the run, which would sleep 30 s at its first commit, outlives its client
    end_of_killed_runs(timeout=5)
    assert not runs & _forked_runs()


def test_ctrl_c_reaches_the_run(tiny_model: Path, conversations: Path, tmp_path: Path) -> None:
    """SIGINT sent to the client stops the CLI child the way Ctrl-C stops the CLI: one line, exit 130."""
    client = _start_slow_extraction(tiny_model, conversations, tmp_path / "out", sleep_s=1.0)
    client.send_signal(signal.SIGINT)
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in stderr, stderr
