"""StopSignals without Ray or Prefect: a signal to the process stops the
function running in the run thread, whatever it is doing in Python, and the
caller learns which signal it was."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from flows.lifetime import Stopped, StopSignals


@pytest.fixture
def signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignals()
    stop.install()
    yield stop
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_thread(signals, signum):
    cleaned = threading.Event()

    def run():
        threading.Timer(0.2, os.kill, (os.getpid(), signum)).start()
        try:
            while True:
                time.sleep(0.01)
        finally:
            cleaned.set()  # the run's own cleanup still runs

    with pytest.raises(Stopped) as info:
        signals.run(run)
    assert info.value.signal_name == signal.Signals(signum).name
    assert cleaned.is_set()


def test_a_second_signal_does_not_cut_the_cleanup_short(signals):
    def run():
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            while True:
                time.sleep(0.01)
        finally:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the second signal arrives during the cleanup
            return "cleaned"  # noqa: B012 - what the test looks for

    assert signals.run(run) == "cleaned"
    assert signals.received == "SIGTERM"


def test_a_signal_before_the_run_stops_it_at_the_next_check(signals):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    with pytest.raises(Stopped):
        signals.check()


def test_the_run_result_and_errors_come_back(signals):
    assert signals.run(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad"):
        signals.run(lambda: (_ for _ in ()).throw(ValueError("bad")))
