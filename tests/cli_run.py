"""The CLI run in this test process: `run_cli(argv)` calls `peagle_pipeline.cli.main(argv)` with its output captured.

For every CLI test that is not about a process (kill -9, signals, torchrun, a vLLM engine, what happens at exit: those
start a real process, tests/cli_argv.py). A run here skips the 2-3 s a fresh interpreter spends importing torch and
transformers, and a failure shows its traceback in pytest's report.

Each call behaves as a fresh `peagle-pipeline` process would, and leaves this process as it found it:
- output: what the run writes to sys.stdout/sys.stderr, to file descriptors 1 and 2 (C libraries, os.write), through
  logging handlers that write to the terminal, and the warnings it shows are captured (warnings under Python's own
  default filters, as in a fresh interpreter, not pytest's);
- environment: `env` replaces os.environ for the call (None: this process's, less PEAGLE_DEBUG), as subprocess's `env`
  does; OMP_NUM_THREADS there sets torch's thread count for the call. Only variables read while a command runs take
  effect (PEAGLE_*, AWS_*, TQDM_DISABLE, ...); one that a library reads at import is refused (`ImportTimeVariable`):
  a test that needs one starts a process;
- imports as the console script sees them: tests/ off sys.path, no filesystem (fsspec, s3fs) cached by an earlier
  run;
- restored after the call: os.environ, the current directory (`cwd` sets it for the call), the SIGINT and SIGTERM
  handlers (`preemption.install()`), logging levels, handlers and filters of the loggers that existed, the warnings
  filters, torch's thread count, grad mode, default dtype and global RNG (set to a fresh process's at the start),
  Python's and NumPy's global RNGs; the objects this process held before the run are frozen during it (`gc.freeze`),
  so its garbage collections skip them as a fresh process's would;
- an exception the CLI lets through (a bug) is reported as a process would report it: its traceback on stderr, code 1.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import random
import signal
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cli_argv import PEAGLE

PEAGLE_PREFIX = PEAGLE
"""tests/cli_argv.PEAGLE: an argv that starts with it (cli_argv.extract_argv, train_argv) is run without it."""

RUNTIME_VARIABLES = (
    *("PEAGLE_", "AWS_", "OMP_NUM_THREADS", "TQDM_DISABLE", "PATH", "PWD", "OLDPWD", "PYTEST_"),
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"),
)
"""Variables a command reads while it runs, or that change nothing in process: `env` may set or drop these.
(tqdm reads TQDM_* at import, but every bar of the package is `disable=None`, off without a terminal, and the
capture is none: as off as TQDM_DISABLE=1 makes it; extract reads TQDM_DISABLE itself when it runs.)"""

TORCH_DEFAULT_SEED = 67280421310721
"""The seed of torch's global generator in a fresh process (torch.initial_seed() before any manual_seed)."""

_PYTHON_DEFAULT_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
)
"""The warnings filters of a fresh interpreter without -W or PYTHONWARNINGS (Python's documented defaults)."""


class ImportTimeVariable(ValueError):
    """`env` changes a variable that is read when a library is imported: it would have no effect in process."""


@dataclass(frozen=True)
class Result:
    """What a run left: its exit code and its captured output (text)."""

    code: int
    stdout: str
    stderr: str

    @property
    def returncode(self) -> int:
        """`code`, under subprocess.CompletedProcess's name (tests written for a subprocess read the same)."""
        return self.code


def run_cli(
    argv: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
) -> Result:
    """Run `peagle-pipeline ARGV` in this process (see the module docstring); returns its code and output."""
    from peagle_pipeline import cli

    args = [str(a) for a in argv]
    if args[: len(PEAGLE_PREFIX)] == PEAGLE_PREFIX:
        args = args[len(PEAGLE_PREFIX) :]
    run_env = dict(os.environ) if env is None else dict(env)
    if env is None:
        run_env.pop("PEAGLE_DEBUG", None)
    _check_runtime_only(run_env)
    with _capture() as (out, err), _isolated(run_env, cwd), _as_installed():
        try:
            code = cli.main(args)
        except SystemExit as stop:  # as a process would exit on it
            code = _exit_code(stop.code)
        except BaseException:  # a bug the CLI lets through: a process prints its traceback and exits 1
            traceback.print_exc()
            code = 1
    return Result(code, out.getvalue(), err.getvalue())


def peagle(*args: str, env: dict[str, str] | None = None, check: bool = True) -> Result:
    """`peagle-pipeline ARGS` in this process (`run_cli`) on one thread (OMP_NUM_THREADS=1 unless env sets it),
    PEAGLE_DEBUG unset; check: raise AssertionError with the stderr tail on a non-zero exit."""
    run_env = dict(os.environ if env is None else env)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    run_env.pop("PEAGLE_DEBUG", None)
    result = run_cli(list(args), run_env)
    if check and result.code != 0:
        raise AssertionError(
            f"peagle-pipeline {' '.join(args)} exited {result.code}:\n{result.stderr[-3000:]}"
        )
    return result


def _check_runtime_only(run_env: dict[str, str]) -> None:
    changed = {k for k in run_env.keys() ^ os.environ.keys()}
    changed |= {k for k in run_env.keys() & os.environ.keys() if run_env[k] != os.environ[k]}
    imported = sorted(k for k in changed if not k.startswith(RUNTIME_VARIABLES))
    if imported:
        raise ImportTimeVariable(
            f"env changes {', '.join(imported)}, read when a library is imported: no effect in process "
            "(start a process: tests/cli_argv.py)"
        )


def _exit_code(code: object) -> int:
    """The exit code `raise SystemExit(code)` gives a Python process (a message goes to stderr, code 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class _Captured:
    """A temporary file that fd `fd` and a text stream both write to, in order."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.file = tempfile.TemporaryFile()
        self.stream = io.TextIOWrapper(
            open(self.file.fileno(), "wb", buffering=0, closefd=False),  # noqa: SIM115 (closed in close())
            encoding="utf-8",
            errors="replace",
            write_through=True,
        )
        self._saved = os.dup(fd)
        os.dup2(self.file.fileno(), fd)

    def close(self) -> str:
        self.stream.flush()
        os.dup2(self._saved, self.fd)
        os.close(self._saved)
        self.stream.close()
        self.file.seek(0)
        text = self.file.read().decode("utf-8", errors="replace")
        self.file.close()
        return text


class _Text:
    def __init__(self) -> None:
        self.text = ""

    def getvalue(self) -> str:
        return self.text


@contextlib.contextmanager
def _capture() -> Iterator[tuple[_Text, _Text]]:
    """Send fds 1 and 2, sys.stdout/sys.stderr and the terminal's logging handlers to two captures."""
    out, err = _Text(), _Text()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    saved = sys.stdout, sys.stderr
    terminal = {id(s) for s in (*saved, sys.__stdout__, sys.__stderr__) if s is not None}
    cap_out, cap_err = _Captured(1), _Captured(2)
    sys.stdout, sys.stderr = cap_out.stream, cap_err.stream
    moved = _move_handlers(lambda s: id(s) in terminal, cap_err.stream)
    try:
        yield out, err
    finally:
        # handlers the run created (a library configured at its first import) write to the terminal again
        _move_handlers(lambda s: s is cap_err.stream or s is cap_out.stream, saved[1])
        for handler, stream in moved:
            handler.setStream(stream)
        sys.stdout, sys.stderr = saved
        out.text, err.text = cap_out.close(), cap_err.close()


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values())]
    return [
        h
        for lg in loggers
        if isinstance(lg, logging.Logger)
        for h in lg.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]


def _move_handlers(which, to: io.TextIOBase) -> list[tuple[logging.StreamHandler, object]]:
    moved = []
    for handler in {id(h): h for h in _stream_handlers()}.values():  # (lastResort follows sys.stderr itself)
        if isinstance(handler, logging.StreamHandler) and which(handler.stream):
            moved.append((handler, handler.setStream(to)))
    return moved


@contextlib.contextmanager
def _isolated(run_env: dict[str, str], cwd: str | os.PathLike[str] | None) -> Iterator[None]:
    """Run the block as a fresh process would see it, and put this process back as it was afterwards."""
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for name in _COMMAND_LOGGERS:  # created now, so that the state put back is theirs before the run
        logging.getLogger(name)
    saved_loggers = _logger_state()
    saved_random = random.getstate()
    numpy = sys.modules.get("numpy")
    saved_numpy = numpy.random.get_state() if numpy is not None else None
    import torch  # every command but --help and plot imports it; its state is saved before it runs

    saved_torch = _torch_state(torch)
    os.environ.clear()
    os.environ.update(run_env)
    if cwd is not None:
        os.chdir(cwd)
    _fresh_torch(torch, run_env)
    gc.freeze()  # the run's collections skip what this process held before it, as a fresh process has none of it
    try:
        with warnings.catch_warnings():
            _fresh_warnings()
            yield
    finally:
        gc.unfreeze()
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        for s, handler in saved_signals.items():
            if handler is not None:
                signal.signal(s, handler)
        _restore_loggers(saved_loggers)
        random.setstate(saved_random)
        if numpy is not None:
            numpy.random.set_state(saved_numpy)
        _restore_torch(torch, saved_torch)


_COMMAND_LOGGERS = ("peagle_pipeline", "asyncio")
"""Loggers a command configures (`runtime.configure_logging`, `cli._report`), whatever existed before the run."""

TESTS_DIR = Path(__file__).resolve().parent


@contextlib.contextmanager
def _as_installed() -> Iterator[None]:
    """Imports as the console script sees them: without tests/ on sys.path (its `vllm` folder would pass for vLLM)
    and without the cached filesystems (fsspec's, s3fs's) of earlier runs, which hold the endpoint they were made
    with."""
    saved_path = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != TESTS_DIR]
    shadows = {name: sys.modules.pop(name) for name in _from_tests()}
    _clear_filesystem_caches()
    try:
        yield
    finally:
        for name in _from_tests():
            del sys.modules[name]
        sys.modules.update(shadows)
        sys.path[:] = saved_path
        _clear_filesystem_caches()


def _from_tests() -> list[str]:
    """Namespace packages imported from a folder of tests/ (`tests/vllm` as `vllm`)."""
    found = []
    for name, module in list(sys.modules.items()):
        attrs = getattr(module, "__dict__", {})  # (not getattr: a lazy module imports on a missing attribute)
        where = attrs.get("__path__")
        if attrs.get("__file__") is None and where is not None:
            if any(Path(p).resolve().is_relative_to(TESTS_DIR) for p in list(where)):
                found.append(name)
    return found


def _clear_filesystem_caches() -> None:
    fsspec = sys.modules.get("fsspec")
    if fsspec is None:
        return
    classes = {*fsspec.registry.values(), *(m.S3FileSystem for m in [sys.modules.get("s3fs")] if m)}
    for cls in classes:
        cls.clear_instance_cache()


def _fresh_warnings() -> None:
    """Python's default filters; warnings shown on sys.stderr at the time (pytest records them otherwise)."""
    warnings.resetwarnings()
    for action, category, module in reversed(_PYTHON_DEFAULT_FILTERS):
        warnings.filterwarnings(action, category=category, module=module or "")
    for option in sys.warnoptions:
        warnings._setoption(option)  # type: ignore[attr-defined]

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show


def _logger_state() -> dict[str, tuple]:
    loggers = {"": logging.getLogger(), **logging.Logger.manager.loggerDict}
    return {
        name: (lg.level, list(lg.handlers), list(lg.filters), lg.disabled, lg.propagate)
        for name, lg in loggers.items()
        if isinstance(lg, logging.Logger)
    }


def _restore_loggers(state: dict[str, tuple]) -> None:
    for name, (level, handlers, filters, disabled, propagate) in state.items():
        lg = logging.getLogger(name or None)
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.filters[:] = filters
        lg.disabled, lg.propagate = disabled, propagate


def _torch_state(torch) -> tuple:  # noqa: ANN001
    return (
        torch.get_num_threads(),
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        torch.get_rng_state(),
    )


def _fresh_torch(torch, run_env: dict[str, str]) -> None:  # noqa: ANN001
    threads = run_env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    torch.set_grad_enabled(True)
    torch.manual_seed(TORCH_DEFAULT_SEED)


def _restore_torch(torch, state: tuple) -> None:  # noqa: ANN001
    threads, grad, dtype, rng = state
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    torch.set_default_dtype(dtype)
    torch.set_rng_state(rng)
