"""Errors a user can cause, each with a one-line message and an exit code.

`cli.main()` is the one place that turns these into a printed line and an exit status; everything
else raises. Never raise these for programming errors (those stay ordinary exceptions with tracebacks).
"""

from __future__ import annotations

import errno

__all__ = [
    "from_os_error",
    "PeagleError",
    "BadInput",
    "BadConfig",
    "IncompatibleCache",
    "CorruptCache",
    "ResumeMismatch",
    "OutputExists",
    "Busy",
    "NumericalFault",
    "OutOfSpace",
    "Interrupted",
    "Terminated",
    "BackendMismatch",
    "SpeculativeMismatch",
    "StoreUnreachable",
    "RankLost",
    "Reported",
]


class PeagleError(Exception):
    """Base of every user-facing error; `str(err)` is the one line printed."""

    exit_code: int = 1


class BadInput(PeagleError):
    """A file, path, model or flag value the user gave cannot be used."""

    exit_code = 2


class BadConfig(BadInput):
    """A pipeline file or flag combination is invalid (unknown key, bad value)."""

    exit_code = 2


class IncompatibleCache(PeagleError):
    """The cache exists but was written by another format version or is incomplete/missing parts."""

    exit_code = 3


class CorruptCache(PeagleError):
    """Data read back does not match its recorded checksum or shape."""

    exit_code = 4


class ResumeMismatch(PeagleError):
    """A resume was asked with settings different from the ones the output was started with."""

    exit_code = 5


class OutputExists(PeagleError):
    """The output directory holds something that is not ours; we never overwrite it."""

    exit_code = 6


class Busy(PeagleError):
    """Another live process holds the lock for this rank or run."""

    exit_code = 7


class NumericalFault(PeagleError):
    """Training produced non-finite losses or gradients too many times in a row."""

    exit_code = 8


class OutOfSpace(PeagleError):
    """The disk filled up; what was committed before stays valid and resumes."""

    exit_code = 9


class BackendMismatch(PeagleError):
    """A target runtime returned something other than what was sent (token ids, lengths, log-prob rows)."""

    exit_code = 10


class SpeculativeMismatch(PeagleError):
    """Greedy output with the draft differs from greedy output without it."""

    exit_code = 11


class StoreUnreachable(PeagleError):
    """The object store holding a cache failed to answer a read (network, endpoint, credentials): the cache is not
    at fault, and such a failure is never skipped as a corrupt sample."""

    exit_code = 12


class RankLost(PeagleError):
    """Another rank of a distributed run died (killed, out of memory, its machine lost): this rank cannot go on;
    the run resumes from its last complete checkpoint."""

    exit_code = 13


class Reported(PeagleError):
    """A failure whose one line another process of the command already printed (a rank of `train
    --nproc-per-node N`, where rank 0 speaks for the run): the command exits with that code and prints nothing."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"exit {exit_code}, reported by a rank")
        self.exit_code = exit_code


class Interrupted(PeagleError):
    """Ctrl-C: committed work is kept; re-run the same command to resume."""

    exit_code = 130


class Terminated(Interrupted):
    """SIGTERM (a preemption by SLURM or Kubernetes): committed work is kept; re-run the same command to resume."""

    exit_code = 143


_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM)
_BAD_PATH = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP)


def from_os_error(err: OSError, what: str | None = None) -> PeagleError | None:
    """The user-facing error of an OS error about a path (`what`, else the error's own file name), or None.

    Disk full (ENOSPC, EFBIG from a file-size limit, EDQUOT) -> OutOfSpace; permission denied or a read-only
    file system -> BadInput; a missing path, a file where a directory is needed or the reverse -> BadInput.
    Anything else is not a user mistake and stays an ordinary exception (None).
    """
    path = what or err.filename or "a file"
    if err.errno in _NO_SPACE:
        return OutOfSpace(
            f"no space left while writing {path}: free some space and re-run the same command to resume"
        )
    if err.errno == errno.EROFS:
        return BadInput(f"cannot write to {path}: read-only file system")
    if err.errno in _DENIED:
        return BadInput(f"permission denied: {path} (check its owner and mode)")
    if err.errno in _BAD_PATH:
        return BadInput(f"{path}: {(err.strerror or 'bad path').lower()}")
    return None
