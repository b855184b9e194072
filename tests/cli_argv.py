"""Helpers for tests about a process: the real CLI started as one (Popen + kill -9, signals, torchrun), and argv.

A CLI test that is not about a process runs the CLI in the test process instead (tests/cli_run.py: `run_cli`,
`peagle`); tests/README.md says which is which.

Runs a test watches while they run, or kills with kill -9 when the run has no process of its own below it
(`start_cli`), are children of a fork server that has done the CLI's imports once (tests/zygote.py): the killed
client takes its run with it, and `end_of_killed_runs` waits until it has gone. Runs a test signals by process group
(DataLoader workers must get the signal too), stops with SIGSTOP or limits between fork and exec start a fresh
interpreter (`PEAGLE` itself), as does every run on a machine with an NVIDIA GPU. PEAGLE_TEST_FORK_SERVER=0 starts
every run fresh.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEAGLE = [sys.executable, "-m", "peagle_pipeline.cli"]
"""`peagle-pipeline` run with this interpreter: PEAGLE + ["train", ...]."""

ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
FORK_SERVER_ENV = "PEAGLE_TEST_FORK_SERVER"
"""Set to 0 to start every CLI run as a fresh interpreter instead of a child of the fork server."""
_RUNTIME_ONLY = ("PEAGLE_", "AWS_", "PYTEST_CURRENT_TEST", "PATH")
"""Variables read when a command runs, never while the server imports: a server serves every value of them."""
_MAX_SERVERS = 3
"""Servers kept per test process (one per import-time environment in use; the tests use two or three)."""
_servers: dict[tuple[tuple[str, str], ...], tuple[subprocess.Popen[str], str]] = {}
_unstartable: set[tuple[tuple[str, str], ...]] = set()


def _server_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(_RUNTIME_ONLY)))


def _server_for(env: dict[str, str]) -> str | None:
    """The socket of a running fork server (tests/zygote.py) that imported under `env`'s import-time variables;
    started on first use, one per such environment and test process. None if it cannot start (then the run starts
    a fresh interpreter, only slower)."""
    key = _server_key(env)
    if key in _servers and _servers[key][0].poll() is None:
        return _servers[key][1]
    if key in _unstartable:
        return None
    socket_path = os.path.join(tempfile.mkdtemp(prefix="peagle-zygote-"), "socket")
    server = subprocess.Popen(
        [sys.executable, str(ZYGOTE), "serve", socket_path],
        env=dict(key),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    if not (server.stdout and server.stdout.readline().startswith("ready")):
        server.kill()
        print(
            f"tests: the fork server did not start (exit {server.wait()}); CLI runs start fresh",
            file=sys.stderr,
        )
        _unstartable.add(key)
        return None
    _servers[key] = (server, socket_path)
    while len(_servers) > _MAX_SERVERS:  # the oldest goes (each holds about 1 GB)
        _stop(*_servers.pop(next(iter(_servers))))
    return socket_path


def _stop(server: subprocess.Popen[str], socket_path: str) -> None:
    server.kill()
    server.wait()
    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)


def fork_server_pids() -> list[int]:
    """Pids of this process's running fork servers."""
    return [server.pid for server, _ in _servers.values() if server.poll() is None]


@atexit.register
def _stop_servers() -> None:
    for server, socket_path in _servers.values():
        _stop(server, socket_path)


def fork_server_allowed() -> bool:
    """Whether runs may fork from the server here: Linux, not turned off, and no NVIDIA GPU (the CUDA driver, once an
    import has touched it, cannot be used after a fork)."""
    return (
        os.environ.get(FORK_SERVER_ENV) != "0"
        and sys.platform == "linux"
        and not os.path.exists("/dev/nvidiactl")
    )


def fast_cli(argv: list[str], env: dict[str, str]) -> list[str]:
    """`argv` of a run to completion under `env`, made to run as a child of the fork server when it is PEAGLE + args
    and the server can run (the child is a real process of the real CLI, its imports already done: tests/zygote.py).
    Anything else is returned unchanged."""
    if argv[: len(PEAGLE)] != PEAGLE or not fork_server_allowed():
        return argv
    socket_path = _server_for(env)
    if socket_path is None:
        return argv
    return [sys.executable, str(ZYGOTE), "run", socket_path, *argv[len(PEAGLE) :]]


def start_cli(argv: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
    """Start `argv` (PEAGLE + args) under `env` through the fork server (`fast_cli`) without waiting, for a run the
    test watches, or kills with kill -9 (`popen`: subprocess.Popen's other arguments). Killing the returned client,
    or its process group, makes the server kill -9 the run itself; call `end_of_killed_runs()` after the kill,
    before anything that must see the run gone (a resume takes its locks). Started fresh where the server cannot
    run."""
    return subprocess.Popen(fast_cli(argv, env), env=env, **popen)


def end_of_killed_runs(timeout: float = 30) -> None:
    """Wait until no fork server of this process has a run left (the server kills a run as soon as it sees its
    client gone, and reaps it at once; this waits those few milliseconds out). Raises TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while any(descendants(pid) for pid in fork_server_pids()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"a fork server's run was still alive {timeout:.0f} s after its client died")
        time.sleep(0.005)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (torchrun starts each rank in a session of its own; the fork server's
    runs are its children)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        top = todo.pop()
        kids = [c for c, p in parent.items() if p == top]
        found += kids
        todo += kids
    return found


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the rank `rank` a launcher started (torchrun, or `train --nproc-per-node`): its child whose
    environment says RANK=rank."""
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return None
    for pid in map(int, children):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


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


EXTRACT_START = "estimated cache size "
"""How extract's start line begins: it says the cache's estimated size once every check has passed."""


def error_lines(stderr: str) -> list[str]:
    """The non-empty lines of a command's stderr but extract's start line (what a run that failed after its start
    printed besides it)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(EXTRACT_START)]


def wait_for_group_exit(pgid: int, timeout: float = 30) -> None:
    """Wait until no live process is left in process group `pgid` (zombies count as gone: their files are closed).
    A killed trainer's DataLoader worker dies a moment after it, and until then it holds the run's lock (the lock's
    file descriptor was inherited by the fork), so a resume started at once could find the run still locked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited while we looked
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                live = True
                break
        if not live:
            return
        time.sleep(0.01)


def wait_until(proc: subprocess.Popen[str], ready: Any, timeout: float = 240) -> None:
    """Poll `ready()` until it holds, failing the test (with the end of `proc`'s stderr) if `proc` ends first or
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}"  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def last_train_step(out: Path) -> int:
    """The last step a training run in `out` logged to metrics.jsonl (0 before its first)."""
    from peagle_pipeline.stages.train import metrics

    steps = [r["step"] for r in metrics.read_metrics(out) if r.get("kind") == "train"]
    return steps[-1] if steps else 0
