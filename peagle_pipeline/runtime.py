"""Process plumbing shared by the stages: atomic files, rank discovery, per-rank locks.

Nothing here knows about models or caches. Importing it has no side effects.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import Busy, OutOfSpace

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "fsync_dir",
    "make_readable",
    "exchange_paths",
    "rank_world_from_env",
    "RankLock",
    "raise_if_no_space",
]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_readable(path: str | os.PathLike[str]) -> None:
    """Give `path` the mode a plain `open(path, "w")` would (0666 less the umask; 0777 for a directory).

    Temporary files (`tempfile.mkstemp`, safetensors' writer) and directories (`mkdtemp`) are created private
    (0600/0700); renamed into place they would keep that, and another user (a vLLM server) could not read them.
    """
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)


def exchange_paths(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported.

    Readers of either name see the old or the new entry, never a missing one. The caller falls back to two
    renames when this returns False (another OS, an old libc, or a file system without the flag).
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def raise_if_no_space(err: OSError, what: str) -> None:
    """Turn ENOSPC/EFBIG/EDQUOT into `OutOfSpace` naming `what`; re-raise anything else."""
    if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        raise OutOfSpace(
            f"no space left while writing {what}: free some space and re-run the same command to resume"
        ) from err
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

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> RankLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(
                f"{self.what} is already being written by another process (lock {self.path}); "
                "stop it first or use another rank"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RankLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
