"""Process plumbing shared by the stages: atomic files, rank discovery, per-rank locks, logging.

The one home of atomic publish (temp + fsync + rename), fsync helpers and the crash-test pause hook
(`pause_for_crash_test`): every writer (cache, checkpoints, exports, on-policy files) uses these.
Nothing here knows about models or caches. Importing it has no side effects. What the hardware offers (CPUs, bf16
units, the compute dtype) is `peagle_pipeline.hardware`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import BadConfig, Busy, OutOfSpace, OutputExists, from_os_error

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "create_exclusive",
    "claim_output_dir",
    "check_output_dir",
    "fsync_dir",
    "fsync_file",
    "atomic_copy",
    "pause_for_crash_test",
    "make_readable",
    "exchange_paths",
    "LAUNCHER_ENV",
    "rank_world_from_env",
    "writer_rank",
    "RankLock",
    "configure_logging",
    "drop_shipped_config_notices",
    "raise_if_no_space",
]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    _fsync(path)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file's data to disk (after it was written and closed)."""
    _fsync(path)


def _fsync(path: str | os.PathLike[str]) -> None:
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pause_for_crash_test(env_var: str) -> None:
    """Crash-test hook: sleep `$env_var` seconds when that variable is set, else nothing.

    Writers call it between the data of a commit and its marker, so a crash test can kill -9 them in that window.
    Unset (always, outside tests) it does nothing.
    """
    delay = os.environ.get(env_var)
    if delay:
        import time

        time.sleep(float(delay))


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


def atomic_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy `src` to `dst` via a temp file + fsync + os.replace, with a plain file's mode (never a half file)."""
    import shutil
    import tempfile

    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        make_readable(tmp)
        fsync_file(tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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


def claim_output_dir(root: Path, marker: str, what: str) -> None:
    """Create the output directory `root`, or accept it when it is empty or already holds `marker` (the file a
    first run writes there); files named `.peagle-*` (our temporaries) do not count.

    Raises:
        OutputExists: `root` is a file, or a directory holding something else (`what`: "a peagle cache", ...).
    """
    check_output_dir(root, marker, what)
    root.mkdir(parents=True, exist_ok=True)


def check_output_dir(root: Path, marker: str, what: str) -> None:
    """`claim_output_dir` without creating anything: a stage checks its output this way before a slow start.

    Raises:
        OutputExists: as `claim_output_dir`.
    """
    if root.exists() and not root.is_dir():
        raise OutputExists(f"output {root} exists and is not a directory; choose another --output")
    if root.exists() and not (root / marker).exists():
        foreign = [p.name for p in root.iterdir() if not p.name.startswith(".peagle-")]
        # (a concurrent first writer of another rank may have put the marker between the two looks: it is the
        # first file a writer puts, so a listing that holds it is that writer's output being started)
        if foreign and marker not in foreign:
            raise OutputExists(
                f"output {root} exists and is not {what} (it holds {foreign[0]!r}, ...); "
                "choose an empty or new directory"
            )


LAUNCHER_ENV = "PEAGLE_LAUNCHER"
"""Set to 1 in the environment of each rank that `train --nproc-per-node N` starts (beside torchrun's variables):
such a rank's exit code is the run's, and the launcher names a rank that died."""


def rank_world_from_env(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values win; else torchrun (RANK/WORLD_SIZE), then SLURM (SLURM_PROCID/SLURM_NTASKS); else (0, 1)."""
    env = os.environ
    if rank is None:
        rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    return rank, world_size


def writer_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size) of a writer process (`rank_world_from_env`), checked.

    Raises:
        BadConfig: world size below 1 or rank outside 0..world_size-1.
    """
    rank, world = rank_world_from_env(rank, world_size)
    if world < 1 or not 0 <= rank < world:
        raise BadConfig(f"rank must be in 0..world_size-1, got rank {rank} of {world}")
    return rank, world


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

    def fileno(self) -> int:
        """The held lock file's descriptor (-1 when not held)."""
        return -1 if self._fd is None else self._fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RankLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _LineHandler(logging.Handler):
    """One line per record on stderr, through tqdm.write so an open progress bar stays intact."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # a logging handler must never raise
            self.handleError(record)


# What a library says about a target's config as it ships, which the user cannot act on: (logger, message start).
# transformers asks every Phi-3 / Phi-3.5 / Phi-4-mini config (LongRoPE without `factor`) to set one.
_SHIPPED_CONFIG_NOTICES = (
    (
        "transformers.modeling_rope_utils",
        "This model config has set a `rope_parameters['original_max_position",
    ),
)


class _DropNotices(logging.Filter):
    """Drops the records whose message starts with `start`."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def drop_shipped_config_notices() -> None:
    """Keep the libraries' notices about a target's config as it ships (`_SHIPPED_CONFIG_NOTICES`) off the
    terminal; idempotent."""
    for name, start in _SHIPPED_CONFIG_NOTICES:
        source = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) and f.start == start for f in source.filters):
            source.addFilter(_DropNotices(start))


def configure_logging(level: int = logging.INFO) -> None:
    """Show this package's log records (`peagle_pipeline.*`) on stderr at `level`; idempotent."""
    logger = logging.getLogger("peagle_pipeline")
    logger.setLevel(level)
    if not any(isinstance(h, _LineHandler) for h in logger.handlers):
        handler = _LineHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
