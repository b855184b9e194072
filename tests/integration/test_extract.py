"""`peagle-pipeline extract` end to end on the real tiny model, through the real CLI: in process for the runs
that go to their end (tests/cli_run.py), as processes for the runs that are killed or run side by side.

Covers: a clean extraction of ~30 generated conversations (+ bad rows, rejected with reasons); inspect/verify;
a no-op re-run; settings mismatch, foreign output dir and a second live writer of a rank refused; two ranks
whose union is the one-rank cache; and kill -9 at random moments followed by a resume that is bit-identical
to the uninterrupted run (marker `crash`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from cache_compare import assert_same_cache
from cli_argv import end_of_killed_runs, extract_argv, start_cli
from cli_run import Result, run_cli

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.location import recorded_length_window
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache

pytestmark = pytest.mark.slow

WORDS = (
    "hello how are you today the quick brown fox jumps over lazy dog answer question capital "
    "France Paris is speculative decoding drafts tokens"
).split()
# Small shards/chunks/batches so a run commits many times.
SMALL = ["--shard-tokens", "256", "--chunk-tokens", "64", "--batch-tokens", "512", "--max-length", "200"]
N_GOOD = 30


def _write_data(path: Path) -> None:
    rng = random.Random(0)

    def sent(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    lines = []
    for i in range(N_GOOD):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [
                {"from": "human", "value": sent(rng.randint(3, 25))},
                {"from": "gpt", "value": sent(rng.randint(3, 50))},
            ]
        lines.append(json.dumps({"conversations": turns}))
        if i == 5:
            lines.append(json.dumps({"conversations": []}))  # empty conversation
        if i == 11:
            lines.append("{this is not json")
        if i == 17:
            lines.append(
                json.dumps({"messages": [{"role": "user", "content": "no reply"}]})
            )  # nothing to supervise
    path.write_text("\n".join(lines) + "\n")


def extract(
    model: Path, data: Path, out: Path, env: dict[str, str], *extra: str, wait: bool = True
) -> Result | subprocess.Popen:
    cmd = extract_argv(model, data, out, *SMALL, *extra)
    if not wait:  # a run the test watches or kills with kill -9: a process
        return start_cli(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return run_cli(cmd, env)


def cli(env: dict[str, str], *args: str) -> Result:
    return run_cli(list(args), env)


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("PEAGLE_DEBUG", None)
    e["OMP_NUM_THREADS"] = "1"  # deterministic CPU kernels across processes (and fair to the shared cores)
    e["TQDM_DISABLE"] = "1"
    return e


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory, env):
    """Data file and the uninterrupted one-rank reference cache."""
    base = tmp_path_factory.mktemp("extract")
    data = base / "conv.jsonl"
    _write_data(data)
    ref = base / "ref"
    proc = extract(tiny_model, data, ref, env)
    assert proc.returncode == 0, proc.stderr
    return {"model": tiny_model, "data": data, "ref": ref, "base": base, "stdout": proc.stdout}


def test_clean_extraction(setup, env):
    cache = open_cache(setup["ref"])
    assert len(cache.samples) == N_GOOD
    # storage order: every window of `length_window` samples sorted by length (one window here); ids are the rows'
    assert N_GOOD <= cache.meta.length_window == 256
    assert cache.samples["length"].is_monotonic_increasing
    assert cache.samples["sample_id"].is_unique and set(cache.samples["sample_id"]) < set(range(N_GOOD + 3))
    reasons = dict(zip(cache.rejects["source_row"], cache.rejects["reason"], strict=True))
    assert len(reasons) == 3
    assert any("empty" in r for r in reasons.values())
    assert any("JSON" in r or "json" in r for r in reasons.values())
    assert any("assistant" in r for r in reasons.values())
    assert cache.samples["truncated"].any() and cache.samples["length"].max() == 200
    s = cache.read_sample(0)
    T = s.input_ids.shape[0]
    assert s.aux_hidden.shape == (T, len(cache.meta.aux_layer_ids), cache.meta.hidden_size)
    assert s.aux_hidden.dtype.is_floating_point and s.topk_ids.shape == (T, 32)
    assert (s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:]).all()  # descending
    assert s.loss_mask.any() and not s.loss_mask.all()
    counts = cache.token_counts()
    assert counts.sum() == cache.samples["num_supervised"].sum()
    assert set(cache.target_pieces()) == set(layout.PIECE_KEYS)
    assert verify_cache(cache) == []
    assert "samples 30" in setup["stdout"] and "rejects 3" in setup["stdout"]


def test_inspect_verify_and_noop_rerun(setup, env):
    out = cli(env, "inspect", str(setup["ref"]))
    assert out.returncode == 0 and "samples: 30" in out.stdout and "bytes/token" in out.stdout
    out = cli(env, "inspect", str(setup["ref"]), "--sample", "2", "--rows", "5")
    assert out.returncode == 0 and "top1_prob" in out.stdout and "more rows" in out.stdout
    out = cli(env, "verify", str(setup["ref"]))
    assert out.returncode == 0 and "ok" in out.stdout
    before = (setup["ref"] / "stores" / layout.store_name(0, 1) / layout.MANIFEST).read_bytes()
    again = extract(setup["model"], setup["data"], setup["ref"], env)
    assert again.returncode == 0 and "already complete" in again.stdout
    assert (setup["ref"] / "stores" / layout.store_name(0, 1) / layout.MANIFEST).read_bytes() == before


def test_verify_reports_damage_with_exit_4(setup, env, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(setup["ref"], bad)
    shard = bad / "stores" / layout.store_name(0, 1) / "aux_hidden" / "c" / "2" / "0" / "0"
    blob = bytearray(shard.read_bytes())
    blob[100] ^= 0x55
    shard.write_bytes(bytes(blob))
    out = cli(env, "verify", str(bad))
    assert out.returncode == 4
    assert "aux_hidden shard 2" in out.stdout and "samples" in out.stdout


def test_settings_mismatch_and_foreign_output_refused(setup, env, tmp_path):
    out = extract(setup["model"], setup["data"], setup["ref"], env, "--topk", "8")
    assert out.returncode == 5 and "topk: 32 in the cache, 8 now" in out.stderr
    out = extract(setup["model"], setup["data"], setup["ref"], env, "--layers", "1,4")
    assert out.returncode == 5 and "aux_layer_ids" in out.stderr
    out = extract(
        setup["model"], setup["data"], setup["ref"], env, "--length-window", "1"
    )  # another storage order
    assert out.returncode == 5 and "length_window: 256 in the cache, 1 now" in out.stderr
    # a cache from before the length sort (cache.json without length_window: row order) is not refused on a re-run
    old = tmp_path / "old"
    shutil.copytree(setup["ref"], old)
    meta = json.loads((old / layout.CACHE_META).read_text())
    del meta["length_window"]
    (old / layout.CACHE_META).write_text(json.dumps(meta))
    for manifest_path in (old / layout.STORES_DIR).glob(
        f"*/{layout.MANIFEST}"
    ):  # each store records the settings too
        manifest = json.loads(manifest_path.read_text())
        del manifest["meta"]["length_window"]
        manifest_path.write_text(json.dumps(manifest))
    assert recorded_length_window(old) == 1
    out = extract(setup["model"], setup["data"], old, env)
    assert out.returncode == 0 and "already complete" in out.stdout.lower(), out.stdout + out.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    out = extract(setup["model"], setup["data"], foreign, env)
    assert out.returncode == 6 and "not a peagle cache" in out.stderr
    out = extract(setup["model"], setup["data"], tmp_path / "badlayer", env, "--layers", "2,9")
    assert out.returncode == 2 and "outside 0..6" in out.stderr


def test_two_ranks_union_equals_one_rank(setup, env, tmp_path):
    out = tmp_path / "two"
    procs = [
        extract(setup["model"], setup["data"], out, env, "--rank", str(r), "--world-size", "2", wait=False)
        for r in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    two, one = open_cache(out), open_cache(setup["ref"])
    stores = two.samples.groupby("store")["sample_id"].apply(list).to_dict()
    assert len(stores) == 2
    r0, r1 = stores[layout.store_name(0, 2)], stores[layout.store_name(1, 2)]
    assert not set(r0) & set(r1)
    assert all(i % 2 == 0 for i in r0) and all(i % 2 == 1 for i in r1)
    assert sorted(r0 + r1) == sorted(one.samples["sample_id"])
    assert sorted(two.rejects["sample_id"]) == sorted(one.rejects["sample_id"])
    for sid in one.samples["sample_id"]:
        a, b = one.read_arrays(int(sid)), two.read_arrays(int(sid))
        assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(
            a["loss_mask"], b["loss_mask"]
        )
    assert np.array_equal(two.token_counts(), one.token_counts())
    assert verify_cache(two) == []


def _wait_for_lock(lock: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if lock.exists() and lock.read_text().strip() == str(proc.pid):
            return
        if proc.poll() is not None:
            raise AssertionError(f"extraction ended before taking its lock: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("lock never taken")


def test_second_process_same_rank_is_busy(setup, env, tmp_path):
    out = tmp_path / "busy"
    # a fresh interpreter, not the fork server's client: SIGSTOP must stop the run itself
    cmd = extract_argv(setup["model"], setup["data"], out, *SMALL)
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_lock(out / "stores" / layout.lock_name(0, 1), first)
        os.kill(first.pid, signal.SIGSTOP)  # hold the lock, however fast this machine is
        second = extract(setup["model"], setup["data"], out, env)
        assert second.returncode == 7 and "already being written" in second.stderr
    finally:
        first.kill()
        first.wait()


@pytest.mark.crash
def test_kill9_at_random_moments_then_resume_is_bit_identical(setup, env, tmp_path):
    """Several kill -9s of a real extraction (before, during and between commits), then resume == reference."""
    out = tmp_path / "crashy"
    rng = random.Random(int(os.environ.get("PEAGLE_CRASH_SEED", "1234")))
    manifest = out / "stores" / layout.store_name(0, 1) / layout.MANIFEST
    kills = 0
    # each commit made 0.25 s slower (between its data and its manifest): a run through the fork server, its
    # imports done, would otherwise often finish before the kill
    slow = dict(env, PEAGLE_TEST_COMMIT_SLEEP="0.25")
    for attempt in range(4):
        proc = extract(setup["model"], setup["data"], out, slow, wait=False)
        if attempt == 0:
            time.sleep(rng.uniform(0.5, 3.0))  # often while the model loads, before any commit
        else:  # after this run made progress: wait for a new commit, then a random extra delay
            start_commits = json.loads(manifest.read_text())["commits"] if manifest.exists() else 0
            end = time.time() + 60
            while time.time() < end and proc.poll() is None:
                if manifest.exists() and json.loads(manifest.read_text())["commits"] > start_commits:
                    break
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
        end_of_killed_runs()
        if manifest.exists() and json.loads(manifest.read_text())["complete"]:
            break
    assert kills >= 2
    final = extract(setup["model"], setup["data"], out, env)
    assert final.returncode == 0, final.stderr
    assert_same_cache(setup["ref"], out)
    assert verify_cache(open_cache(out)) == []


def test_without_a_terminal_progress_comes_as_plain_lines(setup, env, tmp_path):
    """stderr a pipe (SLURM, nohup, `| tee`): no progress bar, a plain line per batch at most every 10 s and at
    the end, so a log shows the extraction going (TQDM_DISABLE=1, as the other tests here set, turns both off)."""
    plain = {k: v for k, v in env.items() if k != "TQDM_DISABLE"}
    proc = extract(setup["model"], setup["data"], tmp_path / "cache", plain)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if " samples, " in line]
    total = len(open_cache(tmp_path / "cache").samples) + len(open_cache(tmp_path / "cache").rejects)
    assert lines and lines[-1].startswith(f"{layout.store_name(0, 1)}: {total}/{total} samples, "), (
        proc.stderr
    )
    assert "\r" not in proc.stderr and "%|" not in proc.stderr  # no bar redrawn into the log
