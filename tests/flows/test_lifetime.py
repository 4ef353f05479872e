"""StopSignals without Ray or Prefect: a signal to the process stops the
function running in the run thread, whatever it is doing in Python, and the
caller learns which signal it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from processes import alive
from rollout_support import REPO
from waiting import wait_until

from flows.lifetime import LocalPrefect, Stopped, StopSignals


@pytest.fixture(scope="session")
def prefect_api_url() -> None:
    """Not the flow tests' Prefect harness: nothing here uses Prefect."""
    return None


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
    handled = threading.Event()

    def handle_and_tell(signum, frame):
        signals._handle(signum, frame)
        handled.set()

    signal.signal(signal.SIGINT, handle_and_tell)

    def run():
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            while True:
                time.sleep(0.01)
        finally:
            os.kill(os.getpid(), signal.SIGINT)
            # The cleanup goes on past the second signal's handler: a second
            # Stopped would end this wait.
            assert handled.wait(10), "the second signal was never handled"
            return "cleaned"  # noqa: B012 - what the test looks for

    assert signals.run(run) == "cleaned"
    assert signals.received == "SIGTERM"


def test_a_signal_before_the_run_stops_it_at_the_next_check(signals):
    signal.raise_signal(signal.SIGTERM)  # its handler has run when this returns
    with pytest.raises(Stopped):
        signals.check()


def test_the_run_result_and_errors_come_back(signals):
    assert signals.run(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad"):
        signals.run(lambda: (_ for _ in ()).throw(ValueError("bad")))


def test_the_reaper_kills_what_it_was_given_when_its_parent_is_killed(tmp_path):
    """A parent registers a child with the reaper, then dies by SIGKILL: the
    child goes too (as Ray's agents do when the CLI is killed)."""
    code = (
        "import os, subprocess, sys, time\n"
        "from flows import lifetime\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "lifetime.reap_on_death(lifetime.descendants(os.getpid()))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not alive(child), 10, "the reaper to kill the child")


def test_the_local_server_has_its_url_before_it_runs(tmp_path, monkeypatch):
    """The CLI's Prefect server: its URL is known (its socket bound) before
    it starts, so the CLI sets PREFECT_API_URL before importing Prefect."""
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    server = LocalPrefect()
    assert server.api_url == f"http://127.0.0.1:{server.port}/api"
    with pytest.raises(RuntimeError, match="not started"):
        server.wait_ready(1)
    server.start()
    first = server.process
    server.start()  # the CLI calls it again after Ray when it started it beside Ray
    assert server.process is first
    try:
        server.wait_ready(300)
        with urllib.request.urlopen(f"{server.api_url}/admin/version", timeout=30) as answer:
            assert answer.status == 200
    finally:
        server.stop()
    assert server.process.returncode is not None


def test_a_local_server_that_exits_is_reported_at_once(monkeypatch):
    """The readiness poll ends when the server process does: the CLI names
    its exit code instead of waiting out its start-up deadline."""
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits 1, whatever its arguments
    server = LocalPrefect()
    server.start()
    began = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="exited with code 1"):
            server.wait_ready(300)
        assert time.monotonic() - began < 60
    finally:
        server.stop()
