"""Concurrent writers and readers of one cache, all real processes.

Four extraction ranks (`--rank i --world-size 4`) write one cache in parallel while a reader process polls
`open_cache` in a loop and reads every sample it lists; meanwhile a second process for rank 2 is refused with
exit 7 (Busy). The reader must only ever see consistent states (every listed sample readable, each sample's
bytes the same in every poll and equal to the final cache), and the final cache must hold exactly the samples
of the one-rank cache (`tiny_cache`, same data and settings) with the same tokens, masks and token counts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_argv import extract_argv, start_cli
from cli_run import run_cli

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache

pytestmark = pytest.mark.slow

WORLD = 4
SETTINGS = [
    "--dtype",
    "fp32",
    "--max-length",
    "256",
    "--shard-tokens",
    "256",
    "--chunk-tokens",
    "64",
    "--batch-tokens",
    "512",
]

READER = r"""
import hashlib, json, os, sys, time
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.errors import IncompatibleCache

cache, stop, report = sys.argv[1:4]
seen, polls, partial, errors, max_samples = {}, 0, 0, [], 0
while not os.path.exists(stop):
    try:
        c = open_cache(cache, check=False)
    except IncompatibleCache as err:
        if "not a peagle cache" not in str(err):
            errors.append(f"open: {err}")
        time.sleep(0.05)
        continue
    except Exception as err:
        errors.append(f"open: {type(err).__name__}: {err}")
        continue
    polls += 1
    n = len(c.samples)
    max_samples = max(max_samples, n)
    if 0 < n and not all(m and m.get("complete") for m in c.manifests.values()):
        partial += 1
    for sid in c.samples["sample_id"].tolist():
        try:
            arrays = c.read_arrays(int(sid))
        except Exception as err:
            errors.append(f"sample {sid}: {type(err).__name__}: {err}")
            continue
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(arrays):
            h.update(name.encode() + arrays[name].tobytes())
        seen.setdefault(str(sid), [])
        if h.hexdigest() not in seen[str(sid)]:
            seen[str(sid)].append(h.hexdigest())
    c.close()
    time.sleep(0.02)  # leave the shared cores to the writers
json.dump({"seen": seen, "polls": polls, "partial": partial, "errors": errors, "max_samples": max_samples},
          open(report, "w"))
"""


def _digest(arrays: dict[str, np.ndarray]) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        h.update(name.encode() + arrays[name].tobytes())
    return h.hexdigest()


def _extract(
    model: Path, data: Path, out: Path, rank: int, env: dict[str, str], fresh: bool = False
) -> subprocess.Popen[str]:
    """Start rank `rank`'s extraction: through the fork server, or with `fresh` as a process of its own (one the
    test pauses with SIGSTOP and whose pid its lock names)."""
    cmd = extract_argv(model, data, out, *SETTINGS, "--rank", str(rank), "--world-size", str(WORLD))
    popen: dict = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen(cmd, env=env, **popen) if fresh else start_cli(cmd, env, **popen)


def _wait_for_lock(lock: Path, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if lock.exists() and lock.read_text().strip() == str(proc.pid):
            return
        assert proc.poll() is None, (
            f"rank ended before taking its lock: {proc.stderr.read() if proc.stderr else ''}"
        )
        time.sleep(0.02)
    raise AssertionError("lock never taken")


def test_four_ranks_one_reader_one_intruder(
    tiny_model: Path, conversations: Path, tiny_cache: Path, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    out, stop, report = tmp_path / "cache", tmp_path / "stop", tmp_path / "reader.json"
    env = dict(cli_env, TQDM_DISABLE="1", PEAGLE_TEST_COMMIT_SLEEP="0.2")
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(out), str(stop), str(report)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks = [_extract(tiny_model, conversations, out, r, env, fresh=r == 2) for r in range(WORLD)]
    try:
        # A second writer of rank 2 while the first holds its lock (paused so it cannot finish first).
        _wait_for_lock(out / layout.STORES_DIR / layout.lock_name(2, WORLD), ranks[2])
        os.kill(ranks[2].pid, signal.SIGSTOP)
        try:
            intruder = run_cli(  # refused at once: in process
                extract_argv(
                    tiny_model, conversations, out, *SETTINGS, "--rank", "2", "--world-size", str(WORLD)
                ),
                env,
            )
        finally:
            os.kill(ranks[2].pid, signal.SIGCONT)
        lines = [line for line in intruder.stderr.splitlines() if line.strip()]
        assert intruder.returncode == 7, intruder.stderr[-2000:]
        assert len(lines) == 1 and "already being written by another process" in lines[0]
        for r, proc in enumerate(ranks):
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"rank {r}: {err[-2000:]}"
    finally:
        stop.touch()
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
        reader.communicate(timeout=120)
    assert reader.returncode == 0, reader.stderr
    seen = json.loads(report.read_text())

    final, one = open_cache(out), open_cache(tiny_cache)
    assert verify_cache(final) == []
    # The reader: consistent at every poll, each sample identical in every poll and in the final cache.
    assert seen["errors"] == [], seen["errors"][:5]
    assert seen["polls"] >= 3 and seen["partial"] >= 1, seen
    for sid, digests in seen["seen"].items():
        assert digests == [_digest(final.read_arrays(int(sid)))], f"sample {sid} changed while being read"
    # One consistent cache: the one-rank cache's samples, each in the store of its rank.
    assert sorted(final.samples["sample_id"]) == sorted(one.samples["sample_id"])
    assert all(
        s == layout.store_name(i % WORLD, WORLD)
        for i, s in zip(final.samples["sample_id"], final.samples["store"], strict=True)
    )
    assert np.array_equal(final.token_counts(), one.token_counts())
    for sid in one.samples["sample_id"].tolist():
        a, b = one.read_sample(sid), final.read_sample(sid)
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_allclose(a.aux_hidden.float(), b.aux_hidden.float(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, rtol=1e-3, atol=1e-3)
    print(
        f"\nconcurrency: {WORLD} ranks + 1 intruder (exit 7); reader polled {seen['polls']} times "
        f"({seen['partial']} partial states, up to {seen['max_samples']} samples), 0 inconsistencies"
    )
