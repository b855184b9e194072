"""A real S3 endpoint on localhost for benchmarks: moto's server in a subprocess, behind a TCP proxy that limits
the bandwidth (both directions share one token bucket) and adds a fixed latency per connection read, so reads from
it behave like a remote object store rather than memory.

    with LocalS3(mbit_s=400, latency_ms=5) as s3:
        s3.upload(local_dir, "bucket/prefix")       # through the server directly (not limited)
        env = s3.env                                 # AWS_* for subprocesses: their traffic goes through the proxy
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["LocalS3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _TokenBucket:
    """`rate` bytes per second, shared by every connection of the proxy."""

    def __init__(self, rate: float) -> None:
        self.rate, self.allowance, self.last, self.lock = rate, 0.0, time.monotonic(), threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.allowance = min(self.rate * 0.05, self.allowance + (now - self.last) * self.rate) - n
            self.last = now
            wait = -self.allowance / self.rate if self.allowance < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class _Proxy:
    """Forwards 127.0.0.1:port to the upstream port through the shared token bucket, with a delay per read."""

    def __init__(self, upstream: int, rate: float, latency_s: float) -> None:
        self.upstream, self.bucket, self.latency_s = upstream, _TokenBucket(rate), latency_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            for a, b, delay in ((client, server, 0.0), (server, client, self.latency_s)):
                threading.Thread(target=self._pipe, args=(a, b, delay), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                self.bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


class LocalS3:
    """moto's S3 server on a free port, and a limited proxy in front of it (see the module docstring)."""

    def __init__(self, mbit_s: float, latency_ms: float) -> None:
        self.mbit_s, self.latency_ms = mbit_s, latency_ms
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.proxy: _Proxy | None = None

    def __enter__(self) -> LocalS3:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/", timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"error: moto server did not start (exit {self.proc.poll()})") from None
                time.sleep(0.1)
        self.proxy = _Proxy(self.port, self.mbit_s * 1e6 / 8, self.latency_ms / 1e3)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proxy:
            self.proxy.close()
        if self.proc:
            self.proc.kill()
            self.proc.wait()

    @property
    def env(self) -> dict[str, str]:
        """Environment for a subprocess that reads through the limited proxy."""
        assert self.proxy is not None
        return {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}",
        }

    def upload(self, local: Path, target: str) -> None:
        """Create the bucket of `target` ("bucket/prefix") and copy the directory `local` there (unlimited)."""
        import fsspec

        fs = fsspec.filesystem(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            key="testing",
            secret="testing",
            skip_instance_cache=True,
        )
        fs.mkdir(target.split("/")[0])
        fs.put(str(local).rstrip("/") + "/", target, recursive=True)
