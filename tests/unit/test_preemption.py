"""Stop signals (peagle_pipeline/preemption.py), with real signals sent to this process."""

from __future__ import annotations

import os
import signal

import pytest

from peagle_pipeline import preemption
from peagle_pipeline.errors import Interrupted, Terminated


@pytest.fixture
def sigterm_restored():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_installed_sigterm_raises_stopped_like_ctrl_c(sigterm_restored) -> None:
    preemption.install()
    with pytest.raises(KeyboardInterrupt) as got:
        os.kill(os.getpid(), signal.SIGTERM)
    assert isinstance(got.value, preemption.Stopped) and got.value.signum == signal.SIGTERM
    err = preemption.stop_error(got.value, ": 3 samples are committed")
    assert isinstance(err, Terminated) and err.exit_code == 143
    assert str(err) == "terminated (SIGTERM): 3 samples are committed"


def test_stop_error_of_ctrl_c_and_of_wrapped_signals() -> None:
    plain = preemption.stop_error(KeyboardInterrupt(), " at step 4 of 9")
    assert (
        type(plain) is Interrupted and plain.exit_code == 130 and str(plain) == "interrupted at step 4 of 9"
    )
    try:  # click wraps the KeyboardInterrupt it caught in Abort: the signal is found through __cause__
        try:
            raise preemption.Stopped(signal.SIGTERM)
        except KeyboardInterrupt as stop:
            raise RuntimeError("Abort") from stop
    except RuntimeError as wrapped:
        assert preemption.signal_of(wrapped) == signal.SIGTERM
    assert preemption.signal_of(ValueError()) == signal.SIGINT
    assert isinstance(preemption.stop_error(signal.SIGTERM, ""), Terminated)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_deferred_holds_the_signal_until_the_block_ends(sig: int, sigterm_restored) -> None:
    preemption.install()
    finished = []
    with pytest.raises(preemption.Stopped) as got:
        with preemption.deferred():
            os.kill(os.getpid(), sig)
            finished.append(True)  # the commit goes on after the signal
    assert finished == [True] and got.value.signum == sig
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    assert signal.getsignal(signal.SIGTERM) is preemption._raise_stopped


def test_stop_request_first_signal_asks_second_stops(sigterm_restored, capfd) -> None:
    with preemption.StopRequest("stopping after this step") as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(preemption.Stopped) as got:
            os.kill(os.getpid(), signal.SIGINT)
        assert got.value.signum == signal.SIGINT
    assert "SIGTERM: stopping after this step" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
