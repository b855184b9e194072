"""A cache written to and read from a real S3 endpoint (moto in server mode, `s3_server` in tests/conftest.py)
with the real CLI: the same bytes as on local disk (one rank, and two ranks writing one prefix at once),
verified and read back through s3://, through a slow link too, resumed after a kill -9 to the identical cache, a
second writer refused, and bad endpoints or buckets refused in one line.

Commands run in this process (`cli.main`, to keep the tests fast) except the one that is killed and the one that
needs another endpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
from cache_compare import assert_same_cache
from cli_argv import PEAGLE, end_of_killed_runs, error_lines, extract_argv, small_train_flags, start_cli
from cli_run import run_cli

from peagle_pipeline import cli
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.errors import StoreUnreachable
from peagle_pipeline.stages.train.packed_batch import read_packed
from peagle_pipeline.stages.train.packing import RowPlan

SETTINGS = ["--dtype", "fp32", "--max-length", "200", "--shard-tokens", "256", "--chunk-tokens", "64",
            "--batch-tokens", "512", "--max-samples", "10"]  # fmt: skip
STORE = layout.store_name(0, 1)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("PEAGLE_STAGING_DIR", str(tmp_path / "staging"))


def _extract(model: Path, data: Path, out: str | Path, *extra: str) -> int:
    return cli.main(
        ["extract", "--model", str(model), "--data", str(data), "--output", str(out), *SETTINGS, *extra]
    )


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


@pytest.mark.slow
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
    assert len(remote) == len(local) == 10
    for sid in local.samples["sample_id"]:
        a, b = remote.read_arrays(int(sid)), local.read_arrays(int(sid))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (int(sid), k)
    assert np.array_equal(remote.token_counts(), local.token_counts())
    # the commands that read a cache take the URL
    assert cli.main(["verify", url]) == 0
    assert cli.main(["inspect", url]) == 0
    assert "samples: 10" in capsys.readouterr().out
    assert cli.main(["inspect", url, "--sample", "0"]) == 0
    assert "<|im_start|>" in capsys.readouterr().out
    # a re-run finds it complete
    assert _extract(tiny_model, conversations, url) == 0
    assert "already complete" in capsys.readouterr().out
    # train reads it by URL
    run = tmp_path / "run"
    train = small_train_flags(depths=2, tokens_per_step=160, steps=2, eval_every=2, num_workers=0)
    assert cli.main(["train", "--cache", url, "--output", str(run), *train]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [1, 2]
    # other settings are refused, as on disk
    argv = ["extract", "--model", str(tiny_model), "--data", str(conversations), "--output", url, *SETTINGS]
    assert cli.main([*argv, "--topk", "16"]) == 5  # ResumeMismatch
    assert "topk: 32 in the cache, 16 now" in capsys.readouterr().err


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
    assert cli.main(["inspect", "s3://no-such-bucket/cache"]) == 2
    assert "cannot read the cache s3://no-such-bucket/cache: bucket 'no-such-bucket' does not exist" in (
        capsys.readouterr().err
    )


def test_unreachable_endpoint_is_one_line(s3_server, tiny_model, conversations, monkeypatch, capsys) -> None:
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.closed_endpoint())
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()  # (fsspec reuses instances: a new one reads the endpoint above)
    try:
        assert _extract(tiny_model, conversations, "s3://peagle-1/cache") == 2
        assert cli.main(["verify", "s3://peagle-1/cache"]) == 2  # reading, too, says so
    finally:
        monkeypatch.undo()
        s3fs.S3FileSystem.clear_instance_cache()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "Traceback" not in str(err)
    assert all("cannot reach s3://peagle-1/cache" in line for line in err)


class _Proxy:
    """A TCP forwarder to the S3 server that can go down (listener and every connection closed: requests in
    flight break, new ones are refused) and come back on the same port: a network outage that keeps the
    server's state. `delay_s` holds back every chunk it forwards (a slow server or link)."""

    def __init__(self, target_port: int, delay_s: float = 0.0) -> None:
        self.target, self.delay_s, self.chunks = target_port, delay_s, 0
        self.port = 0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(self.delay_s)
                self.chunks += 1
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


def _run_until(cmd: list[str], env: dict[str, str], url: str, server, commits: int) -> subprocess.Popen:
    """Start `cmd` and return once the object store's manifest of the store counts `commits` commits."""
    proc = start_cli(cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                     start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while (m := _remote_manifest(server, url)) is None or m["commits"] < commits:  # (read past any proxy)
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"extract did not reach commit {commits}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return proc


def _cut_link(proxy: _Proxy, proc: subprocess.Popen) -> str:
    """Take the link down under a running command and return its stderr once it stops (killed after 120 s)."""
    try:
        proxy.down()
        return proc.communicate(timeout=120)[1]
    finally:
        proxy.down()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.crash
def test_kill9_and_network_outage_mid_run_resume_to_the_identical_cache(
    s3_server, tiny_model, conversations, local_cache, tmp_path
) -> None:
    url = f"s3://{s3_server.bucket()}/faults"
    argv = extract_argv(tiny_model, conversations, url, *SETTINGS)
    lock = f"{url[5:]}/{layout.STORES_DIR}/{layout.lock_name(0, 1)}"
    # 1. kill -9 inside a commit (the commit-sleep hook widens the window between local shard writes and uploads; at
    # 0.5 s a commit the five commits left after the second take 2.5 s, so a loaded host still kills mid-run: at 0.2 s
    # one CI run on 2 busy cores saw the run complete before the kill)
    proc = _run_until(argv, _env(s3_server, PEAGLE_TEST_COMMIT_SLEEP="0.5"), url, s3_server, commits=2)
    time.sleep(0.15)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    end_of_killed_runs()
    killed = _remote_manifest(s3_server, url)
    assert killed is not None and not killed["complete"]
    # what the object store holds is a consistent, committed prefix: verify says incomplete (3), not damaged (4)
    assert cli.main(["verify", url]) == 3
    assert _fs(s3_server).exists(lock)  # the killed writer's lock stays; a re-run on this host takes it over
    # 2. resume through a proxy, then cut the network while it uploads: the run stops in one line
    proxy = _Proxy(s3_server.port)
    env = _env(
        s3_server, AWS_ENDPOINT_URL=proxy.endpoint, AWS_MAX_ATTEMPTS="2", PEAGLE_TEST_COMMIT_SLEEP="0.2"
    )
    proc = _run_until(argv, env, url, s3_server, commits=killed["commits"] + 1)
    err = _cut_link(proxy, proc)
    assert proc.returncode == 2, err
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err
    assert f"cannot upload to {url}" in err and "re-run the same command to resume" in err
    stopped = _remote_manifest(s3_server, url)
    assert stopped is not None and not stopped["complete"] and stopped["commits"] > killed["commits"]
    assert cli.main(["verify", url]) == 3  # the object store kept its last commit, undamaged
    # 3. the network is back: the same command finishes the cache, identical to the uninterrupted local one
    assert _extract(tiny_model, conversations, url) == 0
    final = _remote_manifest(s3_server, url)
    assert final is not None and final["complete"] and final["commits"] > stopped["commits"]
    assert not _fs(s3_server).exists(lock)
    assert_same_cache(local_cache, _download(s3_server, url, tmp_path / "copy"))
    assert cli.main(["verify", url]) == 0


@pytest.mark.slow
def test_two_ranks_write_one_s3_prefix_at_once(s3_server, tiny_model, conversations, tmp_path) -> None:
    """Two processes (standing in for two nodes) extract ranks 0 and 1 into one s3:// prefix at the same time; the
    result reads as the same cache as the two ranks extracted to local disk, verifies, and trains by URL with a
    DataLoader worker."""
    url = f"s3://{s3_server.bucket()}/caches/two-ranks"
    ranks = lambda r: ["--rank", str(r), "--world-size", "2"]  # noqa: E731
    local = tmp_path / "local"
    for r in (0, 1):
        assert _extract(tiny_model, conversations, local, *ranks(r)) == 0
    procs = [
        start_cli(
            extract_argv(tiny_model, conversations, url, *SETTINGS, *ranks(r)),
            _env(s3_server, PEAGLE_STAGING_DIR=str(tmp_path / f"staging-{r}")),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    copy = _download(s3_server, url, tmp_path / "copy")
    assert_same_cache(local, copy)
    assert cli.main(["verify", url]) == 0
    run = tmp_path / "run"
    train = small_train_flags(depths=2, tokens_per_step=160, steps=2, eval_every=2, num_workers=1)
    assert cli.main(["train", "--cache", url, "--output", str(run), *train]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [1, 2]


def test_a_rank_that_sees_another_claim_the_prefix_between_its_reads_joins_the_cache(
    s3_server, tmp_path
) -> None:
    """The window that made two ranks' extraction into one prefix fail now and then: rank A finds no cache.json,
    rank B puts it, and A's listing of the prefix then holds it. A joins the cache B started (it pulls B's
    cache.json) instead of refusing the prefix as foreign."""
    from peagle_pipeline.cache.remote import RemoteCache

    url = f"s3://{s3_server.bucket()}/caches/claimed-between-reads"
    other = b'{"written": "by the other rank"}\n'
    remote = RemoteCache(url, staging=tmp_path / "staging")
    real_exists = remote.fs.exists
    meta_key = remote.key(layout.CACHE_META)

    def exists_then_other_rank_claims(path: str, **kw) -> bool:
        found = real_exists(path, **kw)
        if path == meta_key and not found:  # the other rank's conditional put lands right after this read
            _fs(s3_server).pipe_file(meta_key, other, mode="create")
        return found

    remote.fs.exists = exists_then_other_rank_claims
    assert remote.pull_root() is True
    assert (tmp_path / "staging" / layout.CACHE_META).read_bytes() == other


def test_a_prefix_holding_other_objects_is_refused_in_one_line(
    s3_server, tiny_model, conversations, capsys
) -> None:
    url = f"s3://{s3_server.bucket()}/caches/someone-elses"
    _fs(s3_server).pipe_file(url[5:] + "/notes.txt", b"not a cache")
    assert _extract(tiny_model, conversations, url) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: output {url} exists and is not a peagle cache (it holds 'notes.txt', ...); "
                   "choose an empty or new prefix"]  # fmt: skip
    assert _fs(s3_server).find(url[5:]) == [url[5:] + "/notes.txt"]


@pytest.mark.slow
def test_a_slow_server_gives_the_same_cache(
    s3_server, tiny_model, conversations, local_cache, tmp_path
) -> None:
    """Every chunk to and from the server held back 30 ms (a slow server): extraction and verify still finish, and
    the cache is the local one."""
    url = f"s3://{s3_server.bucket()}/slow"
    proxy = _Proxy(s3_server.port, delay_s=0.03)
    env = _env(s3_server, AWS_ENDPOINT_URL=proxy.endpoint)
    try:
        done = run_cli(extract_argv(tiny_model, conversations, url, *SETTINGS), env)
        assert done.returncode == 0, done.stderr[-2000:]
        checked = run_cli([*PEAGLE, "verify", url], env)
    finally:
        proxy.down()
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert proxy.chunks > 50  # the traffic went through the slow link
    assert_same_cache(local_cache, _download(s3_server, url, tmp_path / "copy"))


@contextlib.contextmanager
def _through(proxy: _Proxy, monkeypatch):
    """In-process readers reach the S3 server through `proxy` (one attempt per request: failures show at once)."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()  # (fsspec reuses instances: a new one reads the endpoint above)
    try:
        yield
    finally:
        proxy.down()
        monkeypatch.undo()
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow
def test_a_read_the_store_does_not_answer_is_not_a_corrupt_sample(
    s3_server, tiny_model, conversations, local_cache, monkeypatch
) -> None:
    """The link to the store goes down between two sample reads: StoreUnreachable (exit 12) that says the cache is
    not damaged, not CorruptCache, and `skip_corrupt` does not drop the sample. The link back, the same reader
    reads every sample as the local cache holds it."""
    url = f"s3://{s3_server.bucket()}/outage"
    assert _extract(tiny_model, conversations, url) == 0
    local = open_cache(local_cache)
    sids = [int(s) for s in local.samples["sample_id"]]
    proxy = _Proxy(s3_server.port)
    with _through(proxy, monkeypatch):
        cache = open_cache(url)
        assert all(
            np.array_equal(v, local.read_arrays(sids[0])[k]) for k, v in cache.read_arrays(sids[0]).items()
        )
        proxy.down()
        with pytest.raises(StoreUnreachable, match=f"cannot read the cache {url} .*the cache is not damaged"):
            cache.read_arrays(sids[-1])
        assert StoreUnreachable.exit_code == 12
        plan = RowPlan(sample_ids=tuple(sids[-2:]), lengths=(4, 4))
        batch = read_packed(cache, plan, 0, 0, need_last_hidden=False, skip_corrupt=True)
        assert batch.unreachable is not None and "cannot read the cache" in batch.unreachable
        assert batch.corrupt == [] and batch.sample_ids == []
        proxy.up()
        for sid in sids:
            want = local.read_arrays(sid)
            assert all(np.array_equal(v, want[k]) for k, v in cache.read_arrays(sid).items())


@pytest.mark.slow
def test_verify_calls_a_store_that_does_not_answer_unreachable_not_damaged(
    s3_server, tiny_model, conversations, monkeypatch
) -> None:
    """The link goes down after the cache is opened: verify stops with StoreUnreachable (exit 12, "not damaged")
    instead of listing every shard as unreadable (exit 4, which would send the user to delete a sound cache).
    With the link back, the same cache verifies clean."""
    from peagle_pipeline.cache.verify import verify_cache

    url = f"s3://{s3_server.bucket()}/verify-outage"
    assert _extract(tiny_model, conversations, url) == 0
    proxy = _Proxy(s3_server.port)
    with _through(proxy, monkeypatch):
        cache = open_cache(url, check=False)
        proxy.down()
        with pytest.raises(StoreUnreachable, match=f"cannot read the cache {url} .*the cache is not damaged"):
            verify_cache(cache)
        proxy.up()
        assert verify_cache(open_cache(url, check=False)) == []


OUTAGE_STEPS = 100  # the link goes down at step 5: far from the end, however slow the host


@pytest.mark.slow
@pytest.mark.crash
def test_training_stops_in_one_line_when_the_store_goes_away_and_resumes(
    s3_server, tiny_model, conversations, tmp_path
) -> None:
    """`train --skip-corrupt` from s3:// through a link that goes down mid-run stops with exit 12 in one line
    (no sample skipped as corrupt); with the link back, `--resume` finishes the run."""
    url = f"s3://{s3_server.bucket()}/train-outage"
    assert _extract(tiny_model, conversations, url) == 0
    run = tmp_path / "run"
    flags = small_train_flags(
        depths=2, tokens_per_step=160, steps=OUTAGE_STEPS, eval_every=OUTAGE_STEPS, num_workers=1
    )
    argv = [*PEAGLE, "train", "--cache", url, "--output", str(run), "--skip-corrupt", *flags]
    proxy = _Proxy(s3_server.port)
    env = _env(s3_server, AWS_ENDPOINT_URL=proxy.endpoint, AWS_MAX_ATTEMPTS="1")
    proc = start_cli(argv, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or metrics.read_text().count('"kind": "train"') < 5:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"train did not reach step 5: {_cut_link(proxy, proc)[-2000:]}")
        time.sleep(0.05)
    err = _cut_link(proxy, proc)
    assert proc.returncode == 12, err
    lines = err.strip().splitlines()  # (the run's progress lines, then its one error line)
    assert "Traceback" not in err and [ln for ln in lines if ln.startswith("error:")] == lines[-1:], err
    assert lines[-1].startswith(f"error: cannot read the cache {url}") and "--resume" in lines[-1]
    steps = [
        json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"kind": "train"' in line
    ]
    assert 5 <= steps[-1] < OUTAGE_STEPS
    proxy.up()
    done = run_cli([*argv, "--resume"], env)
    proxy.down()
    assert done.returncode == 0, done.stderr[-2000:]
    final = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert max(r["step"] for r in final if r.get("kind") == "train") == OUTAGE_STEPS
    assert all(r.get("skipped_corrupt", 0) == 0 for r in final)


def test_the_guides_local_s3_server_runs_as_written(tmp_path) -> None:
    """docs/guides/object-stores.md's way to a local S3 server, run as written (on a free port): `moto_server` from
    this environment, the AWS variables it sets, the bucket it makes; then the bucket is there."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "object-stores.md").read_text()
    block = guide.split("## Trying it on a local S3 server", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines = [line.split("  #", 1)[0].replace("5000", str(port)) for line in block.splitlines()]
    assert lines[0].startswith("moto_server -p ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    server = subprocess.Popen(lines[0].split(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        script = "\n".join(
            [
                "set -e",
                f"for i in $(seq 100); do (echo >/dev/tcp/127.0.0.1/{port}) 2>/dev/null && break; sleep 0.1; done",
                *lines[1:],
                "python -c \"import s3fs; print(s3fs.S3FileSystem().ls(''))\"",
            ]
        )
        proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "bucket" in proc.stdout, proc.stderr
    finally:
        server.kill()
        server.wait()
