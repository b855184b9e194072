"""Stop signals in one place: SIGINT (Ctrl-C) and SIGTERM (how SLURM and Kubernetes preempt a job).

Both stop a command the same way; only the exit code and the first word of the message differ (130
`interrupted`, 143 `terminated (SIGTERM)`). `cli.main()` calls `install()` once, so a SIGTERM raises `Stopped`
(a `KeyboardInterrupt`) exactly where a Ctrl-C raises `KeyboardInterrupt`: every `except KeyboardInterrupt`
that keeps committed work handles both. `deferred()` holds both signals while a commit is written;
`StopRequest` turns them into a request honoured at the next step boundary (training). Never writes files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from peagle_pipeline.errors import Interrupted, Terminated

__all__ = [
    "STOP_SIGNALS",
    "Stopped",
    "install",
    "signal_of",
    "last_stop_signal",
    "stop_error",
    "deferred",
    "StopRequest",
    "ignore_in_worker",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (raised by our handlers; `signum` says which)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        global _last_stop
        _last_stop = signum


_last_stop = 0  # the signal of the last `Stopped` raised in this process (0: none)


def last_stop_signal() -> int:
    """The signal of the last stop raised in this process as `Stopped`, else SIGINT (Python's own Ctrl-C): for a
    caller that sees only the exit code a library made of the stop (typer returns 130 for any of them)."""
    return _last_stop or signal.SIGINT


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install() -> None:
    """Make SIGTERM raise `Stopped(SIGTERM)` like Ctrl-C raises KeyboardInterrupt (main thread only; SIGINT
    keeps Python's own handler). Called by `cli.main()` before any command runs: the command starts with no stop
    seen (`last_stop_signal`), whatever ran before it in this process."""
    global _last_stop
    _last_stop = 0
    if _main_thread():
        signal.signal(signal.SIGTERM, _raise_stopped)


def signal_of(exc: BaseException | None) -> int:
    """The stop signal behind `exc` (a `Stopped`, a plain KeyboardInterrupt = SIGINT, or an exception raised
    from one, as click's Abort is); SIGINT when none is found."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, Stopped):
            return exc.signum
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return signal.SIGINT


def stop_error(signum: int | BaseException | None, what: str) -> Interrupted:
    """The user-facing error of a stop: `Interrupted` (130) for SIGINT, `Terminated` (143) for SIGTERM.

    Args:
        signum: the signal number, or the exception that carried it.
        what: the rest of the line after the first word, e.g. ": 12 samples of ... are committed; re-run ..."
            or " at step 7 of 20: checkpoint step-7 saved; ..." (-> "terminated (SIGTERM) at step 7 of 20: ...").
    """
    num = signum if isinstance(signum, int) else signal_of(signum)
    if num == signal.SIGTERM:
        return Terminated(f"terminated (SIGTERM){what}")
    return Interrupted(f"interrupted{what}")


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while a commit is written, then raise `Stopped` for the first one held.

    A stop inside Zarr's I/O would abandon its event-loop tasks mid-write (and print asyncio noise); a commit takes
    milliseconds, so finishing it first costs nothing and keeps the stop clean. A no-op outside the main thread.
    """
    if not _main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        if previous[s] is not None:  # (None: a handler not installed from Python; leave it)
            signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)
    if caught:
        raise Stopped(caught[0])


class StopRequest:
    """A stop signal as a request: the first SIGINT/SIGTERM sets `signum` (the loop stops at its next step
    boundary, after saving); a second one raises `Stopped` at once. A no-op outside the main thread.

    Use as a context manager around the loop; the previous handlers are restored on exit.
    """

    def __init__(self, notice: str) -> None:
        self.notice = notice
        self.signum = 0
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:
            raise Stopped(signum)
        self.signum = signum
        if self.notice:  # (empty: another process speaks for this one)
            os.write(2, f"\n{signal.Signals(signum).name}: {self.notice}\n".encode())

    def __enter__(self) -> StopRequest:
        if _main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def ignore_in_worker() -> None:
    """In a helper process (a DataLoader worker): ignore stop signals sent to the whole process group, so the
    main process alone decides when to stop (and then ends its workers)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
