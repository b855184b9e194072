"""vLLM's own output goes to a log file; the terminal keeps our progress lines and results.

vLLM logs through a handler of its own on stdout (dozens of WARNING lines per engine, and the traceback of a
chat-template warm-up it recovers from when it has no tokenizer), and its C++, torch and tqdm parts write to the
file descriptors directly. `route_to(folder)` picks the file (`folder/vllm.log`, else a temporary file) and sends
the `vllm` logger and Python warnings there; `announce()` says where, once, as an engine starts; `quiet()` points
file descriptors 1 and 2 at it around each call into vLLM (engine start, generation, shutdown), so worker
processes started inside inherit it too, and turns an engine that died inside (vLLM's EngineDeadError, whose cause
only its log holds) into one line naming that cause. Our own lines are printed between those calls. Never imports
vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from peagle_pipeline.errors import PeagleError

__all__ = ["LOG_FILE", "route_to", "announce", "current", "quiet", "last_error"]

LOG_FILE = "vllm.log"
_LOGGERS = ("vllm", "py.warnings")  # vLLM's records; warnings (FutureWarning, ...) that its imports raise


class _Route:
    """Where vLLM's output goes now: the file, its logging handler, how deep `quiet()` is nested."""

    path: Path | None = None
    announced: Path | None = None
    handler: logging.Handler | None = None
    depth = 0
    terminal_err: int | None = None  # inside quiet(): a duplicate of the stderr it replaced


def current() -> Path | None:
    """The log file vLLM's output goes to now (None before `route_to`)."""
    return _Route.path


def route_to(folder: str | os.PathLike[str] | None) -> Path:
    """Send vLLM's output to `folder/vllm.log` (appended; a temporary file for None).

    Call before vLLM is imported where possible: vLLM then skips its own logging set-up
    (`VLLM_CONFIGURE_LOGGING=0`); a handler it already installed is replaced.

    Returns:
        The log file's path.
    """
    if folder is None:
        path = Path(tempfile.gettempdir()) / f"peagle-vllm-{os.getpid()}.log"
    else:
        path = Path(folder) / LOG_FILE
    if current() == path:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    old = _Route.handler
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logging.captureWarnings(True)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):  # vLLM's stdout handler, or our previous file
            if h is old or isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
        logger.addHandler(handler)
        logger.propagate = False
        if name == "vllm":
            logger.setLevel(logging.INFO)
    if old is not None:
        old.close()
    _Route.path, _Route.handler = path, handler
    return path


def announce() -> Path:
    """Say where vLLM's messages go, once per log file (called as an engine starts)."""
    path = current() or route_to(None)
    if _Route.announced != path:
        _Route.announced = path
        line = f"vLLM's own messages go to {path}\n"
        if _Route.terminal_err is not None:  # inside quiet(): to the stderr it replaced
            os.write(_Route.terminal_err, line.encode())
        else:
            sys.stderr.write(line)
            sys.stderr.flush()
    return path


@contextlib.contextmanager
def quiet() -> Iterator[Path]:
    """Inside: file descriptors 1 and 2 write to the log file (nested uses share the outer redirect).

    Yields:
        The log file's path (`route_to(None)`'s temporary file when no folder was chosen).
    """
    path = current() or route_to(None)
    if _Route.depth:
        _Route.depth += 1
        try:
            yield path
        finally:
            _Route.depth -= 1
        return
    _flush()
    saved = (os.dup(1), os.dup(2))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    _Route.depth, _Route.terminal_err = 1, saved[1]
    start = path.stat().st_size
    try:
        yield path
    except Exception as err:
        if type(err).__name__ != "EngineDeadError":  # by name: this module never imports vLLM
            raise
        raise PeagleError(f"vLLM's engine stopped: {last_error(path, start)} (vLLM's log: {path})") from None
    finally:
        _Route.depth, _Route.terminal_err = 0, None
        _flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


_ERROR_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?\w*(?:Error|Exception): .+")


def last_error(log: Path, start: int = 0) -> str:
    """The last exception line (`SomeError: ...`) the log got after byte `start`, other than the engine's own
    EngineDeadError; when there is none, what that means (a process killed by a signal writes none)."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return "its log could not be read"
    found = [x.strip() for x in lines if _ERROR_LINE.match(x) and "EngineDeadError" not in x]
    return (
        found[-1]
        if found
        else "no error in its log (a process killed by a signal, or for memory, says nothing)"
    )


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
