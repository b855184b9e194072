"""tests/cli_run.py: an in-process CLI run captures what a process would print and leaves this process as it was."""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings

import pytest
import torch
from cli_run import ImportTimeVariable, run_cli

import peagle_pipeline.cache.reader as reader


class _Opened:
    """What `inspect` prints from (the tests here are about the run around it)."""

    def summary(self) -> str:
        return "summary"


def test_exit_code_and_output() -> None:
    result = run_cli(["--version"])
    assert result.code == result.returncode == 0 and result.stdout.startswith("peagle-pipeline ")
    usage = run_cli(["extract", "--no-such-flag"])
    assert usage.code == 2 and "No such option" in usage.stderr and usage.stdout == ""


def test_what_a_process_would_print_is_captured(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Python's streams, fd 2 itself, a logging handler of the terminal and a warning: all in the run's stderr."""
    terminal = logging.StreamHandler()  # bound to sys.stderr before the run, as a library's handler is
    logging.getLogger("peagle_pipeline.test_cli_run").addHandler(terminal)

    def noisy(*args, **kwargs):
        print("to stdout")
        os.write(2, b"fd two\n")
        logging.getLogger("peagle_pipeline.test_cli_run").warning("a logged warning")
        warnings.warn("a shown warning", UserWarning, stacklevel=1)
        return _Opened()

    monkeypatch.setattr(reader, "open_cache", noisy)
    try:
        result = run_cli(["inspect", str(tmp_path)])
    finally:
        logging.getLogger("peagle_pipeline.test_cli_run").removeHandler(terminal)
    assert "to stdout" in result.stdout
    assert all(s in result.stderr for s in ("fd two", "a logged warning", "UserWarning: a shown warning"))
    assert terminal.stream is sys.stderr  # back on the terminal after the run


def test_a_bug_is_reported_as_a_process_would(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(reader, "open_cache", broken)
    result = run_cli(["inspect", str(tmp_path)])
    assert result.code == 1 and "Traceback" in result.stderr and "RuntimeError: a bug" in result.stderr


def test_process_state_is_restored(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Signal handlers (main() installs one for SIGTERM), logging, environment, directory, torch's settings."""
    seen = {}

    def look(*args, **kwargs):
        seen.update(
            term=signal.getsignal(signal.SIGTERM),
            env=os.environ.get("PEAGLE_TEST_MARK"),
            cwd=os.getcwd(),
            threads=torch.get_num_threads(),
            seed=torch.initial_seed(),
        )
        logging.getLogger("peagle_pipeline").setLevel(logging.DEBUG)
        logging.getLogger("peagle_pipeline").addHandler(logging.NullHandler())
        torch.set_num_threads(1)
        torch.manual_seed(7)
        os.chdir("/")
        return _Opened()

    monkeypatch.setattr(reader, "open_cache", look)
    # an earlier test of this process may have called main() itself, which leaves its SIGTERM handler installed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    term, threads = signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    package = logging.getLogger("peagle_pipeline")
    level, handlers = package.level, list(package.handlers)
    rng = torch.get_rng_state()
    env = dict(os.environ, PEAGLE_TEST_MARK="1", OMP_NUM_THREADS="1")
    assert run_cli(["inspect", "cache"], env=env, cwd=tmp_path).code == 0
    assert seen["term"] is not term and seen["env"] == "1" and seen["cwd"] == str(tmp_path)
    assert seen["threads"] == 1 and seen["seed"] == 67280421310721
    assert signal.getsignal(signal.SIGTERM) is term and "PEAGLE_TEST_MARK" not in os.environ
    assert (package.level, package.handlers) == (level, handlers)
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    assert os.getcwd() != "/"


def test_an_import_time_variable_is_refused() -> None:
    with pytest.raises(ImportTimeVariable, match="HF_HUB_OFFLINE"):
        run_cli(["--version"], env=dict(os.environ, HF_HUB_OFFLINE="1"))
