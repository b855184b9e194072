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
    "create_exclusive",
    "fsync_dir",
    "rank_world_from_env",
    "RankLock",
    "raise_if_no_space",
    "resolve_compute_dtype",
    "cpu_has_bf16",
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


def create_exclusive(path: str | os.PathLike[str], text: str) -> bool:
    """Write `path` only if it is absent, atomically (temp + fsync + link): concurrent first writers cannot
    interleave. Returns True when this call created it."""
    path = Path(path)
    tmp = path.with_name(f".peagle-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
        fsync_dir(path.parent)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        raise_if_no_space(err, str(path))
        raise
    finally:
        tmp.unlink(missing_ok=True)


def rank_world_from_env(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values win; else torchrun (RANK/WORLD_SIZE), then SLURM (SLURM_PROCID/SLURM_NTASKS); else (0, 1)."""
    env = os.environ
    if rank is None:
        rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    return rank, world_size


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True when the host CPU has bf16 matrix/vector units (AMX-BF16 or AVX512-BF16), read from /proc/cpuinfo.

    Without them bf16 matmuls on the CPU are emulated and slower than fp32.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def resolve_compute_dtype(requested: str, device: str) -> str:
    """`auto` -> "bf16" on CUDA, on a CPU with bf16 units "bf16", else "fp32"; "bf16"/"fp32" pass through.

    Args:
        requested: "auto", "bf16" or "fp32".
        device: a device name ("cpu", "cuda", "cuda:1"); only its type matters.
    """
    if requested in ("bf16", "fp32"):
        return requested
    if requested != "auto":
        raise ValueError(f"compute dtype must be auto, bf16 or fp32, got {requested!r}")
    if device.split(":")[0] == "cuda":
        return "bf16"
    return "bf16" if cpu_has_bf16() else "fp32"


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
