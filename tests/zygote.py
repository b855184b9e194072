"""A fork server for the CLI runs the process tests start: import what `peagle-pipeline` imports once, then fork a
child per run.

A tiny `extract` spends most of its seconds importing torch, transformers and a model class (about 6 of its 7.7 s on
a 2-core AVX2 host), and a kill -9 loop starts the CLI again after every kill. Here one server process per
environment imports those modules, then for each run forks a child that takes the caller's stdin/stdout/stderr,
environment, working directory and umask, and runs `peagle_pipeline.cli.main()` as the `peagle-pipeline` console
script does, then exits as the interpreter would (non-daemon threads joined, atexit handlers run, output flushed)
less the teardown of the thousands of modules it holds. The child is a real process running the real CLI; only the
imports are shared.

    server: python tests/zygote.py serve SOCKET      (prints "ready" once the imports are done)
    client: python tests/zygote.py run SOCKET ARGS   (exits with the child's code; -N if a signal N ended it)

The client is what the test starts (`cli_argv.start_cli`): SIGINT and SIGTERM sent to it are passed on to the
child, and when the client dies (the test kills it with kill -9, or a timeout does) the server kills the child.
Tests that signal a run's process group with DataLoader workers in it, pause it with SIGSTOP or set limits between
fork and exec start a fresh interpreter instead.

Output the imports themselves print (a third-party warning at import) is kept and written to each child's stderr
first, so a test that asserts a clean terminal still sees it.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
import sys

PRELOAD = (
    "peagle_pipeline.cli",
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "peagle_pipeline.stages.extract.stage",
    "peagle_pipeline.stages.train.stage",
    "peagle_pipeline.stages.generate.stage",
    "peagle_pipeline.stages.export.stage",
    "peagle_pipeline.stages.evaluate.stage",
    "peagle_pipeline.stages.train.metrics",
    "peagle_pipeline.cache.verify",
    "zarr",
    "pandas",
    "pyarrow.parquet",
    "pyarrow.dataset",
    "pydantic",
    "torch.utils.tensorboard",
    "matplotlib.pyplot",
)
"""Imported by the server before it forks: the package's commands and what they import lazily."""

_LENGTH = struct.Struct("!I")
_CODE = struct.Struct("!i")
_POLL_S = 0.05


def _preload() -> bytes:
    """Import PRELOAD with fds 1 and 2 sent to a temporary file; returns what was printed."""
    import importlib
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as noise:
        os.dup2(noise.fileno(), 1)
        os.dup2(noise.fileno(), 2)
        try:
            for name in PRELOAD:
                importlib.import_module(name)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        noise.seek(0)
        printed = noise.read()
    gc.freeze()  # the children's collections skip the imported objects: no copy-on-write of the whole heap
    return printed


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's request: its JSON header and its fds 0, 1, 2."""
    data, fds, _flags, _addr = socket.recv_fds(conn, _LENGTH.size, 3)
    (length,) = _LENGTH.unpack(data)
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise ConnectionError("client went away mid-request")
        body += chunk
    return json.loads(body), fds


def _serve(path: str) -> tuple[dict, list[int], bytes]:
    """Accept runs until the parent (the pytest process) goes; returns only in a forked child, with its request."""
    noise = _preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[socket.socket, int] = {}
    while True:
        readable, _, _ = select.select([listener, *children], [], [], _POLL_S)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                request, fds = _recv_request(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in (*children, conn):
                        other.close()
                    return request, fds, noise
                for fd in fds:
                    os.close(fd)
                children[conn] = pid
            else:
                message = sock.recv(2)
                if len(message) == 2:  # b"S" + a signal the client received: pass it on
                    os.kill(children[sock], message[1])
                elif not message:  # the client died: its run dies with it
                    _kill(children.pop(sock))
                    sock.close()
        for conn, pid in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                try:
                    conn.sendall(_CODE.pack(os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()
                del children[conn]
        if os.getppid() != parent:
            for pid in children.values():
                _kill(pid)
            os._exit(0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def _become_the_run(request: dict, fds: list[int], noise: bytes) -> None:
    """In the forked child: take the caller's fds, environment, directory and umask, then run the CLI."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    if noise:
        os.write(2, noise)
    import peagle_pipeline.cli as cli

    sys.argv = [cli.__file__, *request["args"]]
    try:
        cli.main()
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    _exit_without_teardown(code)


def _exit_code(code: object) -> int:
    """The exit code `raise SystemExit(code)` gives a Python process (a message goes to stderr, code 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit_without_teardown(code: int) -> None:
    """Exit as the interpreter does (wait for non-daemon threads, run atexit, flush), less the teardown of every
    module the server imported (0.35 s a run): the child's own objects need none, its files are closed by the OS."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _client(path: str, args: list[str]) -> int:
    """Ask the server at `path` to run `peagle-pipeline ARGS` here; returns its exit code."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    env = dict(os.environ)
    umask = os.umask(0)
    os.umask(umask)
    body = json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "umask": umask}).encode()
    socket.send_fds(conn, [_LENGTH.pack(len(body))], [0, 1, 2])
    conn.sendall(body)

    def forward(signum: int, _frame: object) -> None:
        conn.sendall(b"S" + bytes([signum]))

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    reply = b""
    while len(reply) < _CODE.size:
        chunk = conn.recv(_CODE.size - len(reply))
        if not chunk:
            return 1  # the server died
        reply += chunk
    (code,) = _CODE.unpack(reply)
    if code < 0:  # end as the child ended: by the same signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    verb, sock_path, *rest = sys.argv[1:]
    if verb == "serve":
        sys.path.remove(os.path.dirname(os.path.abspath(__file__)))  # the child imports as the CLI would
        _become_the_run(*_serve(sock_path))
    else:
        sys.exit(_client(sock_path, rest))
