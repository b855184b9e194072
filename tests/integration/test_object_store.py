"""A cache written to and read from a real S3 endpoint (moto in server mode, `s3_server` in tests/conftest.py)
with the real CLI: the same bytes as on local disk, verified and read back through s3://, resumed after a kill -9
to the identical cache, a second writer refused, and bad endpoints or buckets refused in one line.

Commands run in this process (`cli.main`, to keep the tests fast) except the one that is killed and the one that
needs another endpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
from cache_compare import assert_same_cache
from cli_argv import extract_argv, run_peagle

from peagle_pipeline import cli
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache

pytestmark = [pytest.mark.crash]

SETTINGS = ["--dtype", "fp32", "--max-length", "200", "--shard-tokens", "256", "--chunk-tokens", "64",
            "--batch-tokens", "512", "--max-samples", "16"]  # fmt: skip
STORE = layout.store_name(0, 1)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("PEAGLE_STAGING_DIR", str(tmp_path / "staging"))


def _extract(model: Path, data: Path, out: str | Path) -> int:
    return cli.main(["extract", "--model", str(model), "--data", str(data), "--output", str(out), *SETTINGS])


def _env(server, **extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **server.env, **extra}
    env.pop("PEAGLE_DEBUG", None)
    return env


def _fs(server):
    return fsspec.filesystem("s3", endpoint_url=server.endpoint, skip_instance_cache=True)


def _download(server, url: str, dest: Path) -> Path:
    """A local copy of every object under `url` (to compare it file by file with a local cache)."""
    _fs(server).get(url.removeprefix("s3://") + "/", str(dest) + "/", recursive=True)
    return dest


def _remote_manifest(server, url: str) -> dict | None:
    try:
        return json.loads(_fs(server).cat_file(f"{url[5:]}/{layout.STORES_DIR}/{STORE}/{layout.MANIFEST}"))
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def local_cache(tiny_model, conversations, tmp_path_factory) -> Path:
    """The reference: the same extraction to local disk."""
    out = tmp_path_factory.mktemp("local") / "cache"
    assert _extract(tiny_model, conversations, out) == 0
    return out


def test_extract_to_s3_is_the_local_cache(
    s3_server, tiny_model, conversations, local_cache, tmp_path, capsys
) -> None:
    url = f"s3://{s3_server.bucket()}/caches/tiny"
    assert _extract(tiny_model, conversations, url) == 0
    assert f"in {url}:" in capsys.readouterr().out
    assert not _fs(s3_server).exists(f"{url[5:]}/{layout.STORES_DIR}/{layout.lock_name(0, 1)}")  # released
    # every object is byte-identical to the file of the local extraction
    copy = _download(s3_server, url, tmp_path / "copy")
    assert_same_cache(local_cache, copy)
    local_files = sorted(p.relative_to(local_cache).as_posix() for p in local_cache.rglob("*") if p.is_file())
    remote_files = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file())
    assert remote_files == [f for f in local_files if not f.endswith(".lock")]
    for rel in remote_files:
        if rel == layout.EXTRACT_YAML:  # the settings as given: they differ in the output only
            assert f"output: {url}\n" in (copy / rel).read_text()
            continue
        assert (copy / rel).read_bytes() == (local_cache / rel).read_bytes(), rel
    # read back through s3:// in this process: the same arrays as the local cache
    remote, local = open_cache(url), open_cache(local_cache)
    assert len(remote) == len(local) == 16
    for sid in local.samples["sample_id"]:
        a, b = remote.read_arrays(int(sid)), local.read_arrays(int(sid))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (int(sid), k)
    assert np.array_equal(remote.token_counts(), local.token_counts())
    # the commands that read a cache take the URL
    assert cli.main(["verify", url]) == 0
    assert cli.main(["inspect", url]) == 0
    assert "samples: 16" in capsys.readouterr().out
    assert cli.main(["inspect", url, "--sample", "0"]) == 0
    assert "<|im_start|>" in capsys.readouterr().out
    # a re-run finds it complete
    assert _extract(tiny_model, conversations, url) == 0
    assert "already complete" in capsys.readouterr().out


def test_kill9_mid_extract_resumes_to_the_identical_cache(
    s3_server, tiny_model, conversations, local_cache, tmp_path
) -> None:
    url = f"s3://{s3_server.bucket()}/killed"
    # the commit-sleep hook widens the window between a commit's local shard writes and its uploads
    env = _env(s3_server, PEAGLE_TEST_COMMIT_SLEEP="0.3")
    proc = subprocess.Popen(extract_argv(tiny_model, conversations, url, *SETTINGS), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    try:
        while (m := _remote_manifest(s3_server, url)) is None or m["commits"] < 2:
            assert proc.poll() is None, f"extract ended before the kill: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no commit reached the object store"
            time.sleep(0.05)
        time.sleep(0.15)  # inside the next commit's window
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = _remote_manifest(s3_server, url)
    assert killed is not None and not killed["complete"]
    # what the object store holds is a consistent, committed prefix: verify says incomplete (3), not damaged (4)
    assert cli.main(["verify", url]) == 3
    # the killed writer's lock object is still there; a re-run on this host sees its pid dead and takes over
    assert _fs(s3_server).exists(f"{url[5:]}/{layout.STORES_DIR}/{layout.lock_name(0, 1)}")
    assert _extract(tiny_model, conversations, url) == 0
    final = _remote_manifest(s3_server, url)
    assert final is not None and final["complete"] and final["commits"] > killed["commits"]
    assert_same_cache(local_cache, _download(s3_server, url, tmp_path / "copy"))
    assert cli.main(["verify", url]) == 0


def test_a_live_writers_lock_refuses_a_second_writer(
    s3_server, tiny_model, conversations, local_cache, capsys
) -> None:
    url = f"s3://{s3_server.bucket()}/locked"
    fs = _fs(s3_server)
    fs.put_file(str(local_cache / layout.CACHE_META), f"{url[5:]}/{layout.CACHE_META}")  # a first run's claim
    lock = f"{url[5:]}/{layout.STORES_DIR}/{layout.lock_name(0, 1)}"
    fs.pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 1, "since": 0}).encode())  # its live writer
    assert _extract(tiny_model, conversations, url) == 7  # Busy
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "pid 1 on elsewhere" in err and lock in err
    assert not fs.exists(f"{url[5:]}/{layout.STORES_DIR}/{STORE}")  # nothing of the store written
    assert json.loads(fs.cat_file(lock))["host"] == "elsewhere"  # its lock untouched


def test_missing_bucket_is_one_line(s3_server, tiny_model, conversations, capsys) -> None:
    assert _extract(tiny_model, conversations, "s3://no-such-bucket/cache") == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "bucket 'no-such-bucket' does not exist" in err


def test_unreachable_endpoint_is_one_line(s3_server, tiny_model, conversations) -> None:
    env = _env(s3_server, AWS_ENDPOINT_URL=s3_server.closed_endpoint(), AWS_MAX_ATTEMPTS="1")
    proc = run_peagle("extract", "--model", str(tiny_model), "--data", str(conversations), "--output",
                      "s3://peagle-1/cache", *SETTINGS, env=env, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "cannot reach s3://peagle-1/cache" in proc.stderr
