"""Process plumbing shared by the stages: atomic files, rank discovery, per-rank locks.

Nothing here knows about models or caches. Importing it has no side effects.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import Busy, OutOfSpace, from_os_error

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "fsync_dir",
    "rank_world_from_env",
    "RankLock",
    "StopOnSigint",
    "configure_logging",
    "raise_if_no_space",
]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raise_if_no_space(err: OSError, what: str) -> None:
    """Turn ENOSPC/EFBIG/EDQUOT into `OutOfSpace` naming `what`; re-raise anything else."""
    mapped = from_os_error(err, what)
    if isinstance(mapped, OutOfSpace):
        raise mapped from err
    raise err


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` via temp file + fsync + os.replace: readers see old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise_if_no_space(err, str(path))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def rank_world_from_env(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values win; else torchrun (RANK/WORLD_SIZE), then SLURM (SLURM_PROCID/SLURM_NTASKS); else (0, 1)."""
    env = os.environ
    if rank is None:
        rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    return rank, world_size


class RankLock:
    """An exclusive advisory lock file (flock). The kernel drops it when the process dies, even by kill -9.

    Raises `Busy` if another live process holds it.
    """

    def __init__(
        self, path: str | os.PathLike[str], what: str, hint: str = "stop it first or use another rank"
    ) -> None:
        self.path = Path(path)
        self.what = what
        self.hint = hint
        self._fd: int | None = None

    def acquire(self, write_pid: bool = True) -> RankLock:
        """Take the lock; `write_pid=False` leaves the file's content alone (call `write_pid()` later), so a
        process that only checks and then gives up changes nothing on disk."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = f" (pid {int(self.path.read_text().split()[0])})"
            except (OSError, ValueError, IndexError):
                holder = ""
            raise Busy(
                f"{self.what} is already being written by another process{holder} (lock {self.path}); {self.hint}"
            ) from None
        self._fd = fd
        if write_pid:
            self.write_pid()
        return self

    def write_pid(self) -> None:
        """Record this process's id in the held lock file (named by `Busy` messages of other processes)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RankLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class StopOnSigint:
    """Ctrl-C as a request: the first SIGINT sets `requested` (the loop stops at its next step boundary, after
    saving); a second one raises KeyboardInterrupt at once. A no-op outside the main thread.

    Use as a context manager around the loop; the previous handler is restored on exit.
    """

    def __init__(self, notice: str) -> None:
        self.notice = notice
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        os.write(2, f"\n{self.notice}\n".encode())

    def __enter__(self) -> StopOnSigint:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


class _LineHandler(logging.Handler):
    """One line per record on stderr, through tqdm.write so an open progress bar stays intact."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # a logging handler must never raise
            self.handleError(record)


def configure_logging(level: int = logging.INFO) -> None:
    """Show this package's log records (`peagle_pipeline.*`) on stderr at `level`; idempotent."""
    logger = logging.getLogger("peagle_pipeline")
    logger.setLevel(level)
    if not any(isinstance(h, _LineHandler) for h in logger.handlers):
        handler = _LineHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
