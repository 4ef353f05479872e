"""What the CLI starts lives no longer than the CLI, and SIGTERM is a clean stop.

- The local Prefect server is a child the CLI starts itself (instead of
  Prefect's ephemeral one, which outlives a killed parent): it dies with the
  CLI through the kernel's parent-death signal, even under SIGKILL, listens on
  loopback only, on a socket the CLI bound (no port race between two CLIs).
- A local Ray started by the CLI: Ray binds its own processes to their
  driver's life the same way (`fate_share`, prctl PR_SET_PDEATHSIG in
  `ray._private.services`); engine workers end with their raylet.
- SIGTERM and SIGINT stop the run (`StopSignals`): it ends as Crashed with
  its hooks run, and the CLI then stops what it started. Ray's driver
  installs a C++ failure handler that prints a stack dump and aborts on
  SIGTERM, and a Python one that calls `sys.exit(1)`; the CLI turns the first
  off and takes the signals back after `ray.init`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

T = TypeVar("T")

#: prctl(2) option: the signal the kernel sends a child when its parent dies.
PR_SET_PDEATHSIG = 1
#: Ray's switch for its C++ failure signal handler (ray_constants).
RAY_DISABLE_FAILURE_SIGNAL_HANDLER = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


class Stopped(BaseException):
    """The CLI was asked to stop (SIGTERM, SIGINT). A BaseException, like
    KeyboardInterrupt: no `except Exception` on the way may swallow it."""

    def __init__(self, signal_name: str = "SIGTERM or SIGINT") -> None:
        super().__init__(f"the command was stopped by {signal_name}")
        self.signal_name = signal_name


class StopSignals:
    """SIGTERM and SIGINT stop the run at the next Python statement of the
    thread that runs it.

    A Python signal handler runs in the main thread, at whatever call it
    interrupts: raised inside `ray.get`/`ray.wait` its exception comes out as
    a SystemError after the call's full timeout (Ray's Cython wrappers drop
    it); Prefect's own SIGTERM handler fails the same way. So the run goes in
    a thread of its own (Prefect then leaves SIGTERM alone), the handler only
    records the signal, and the run thread gets `Stopped` as an asynchronous
    exception, raised when it is back in Python code.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._target: int | None = None
        self._sent = False

    def install(self) -> None:
        """(Again after anything that installs its own: a local `ray.init`.)"""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:  # a second signal does not cut the cleanup short
            self.received = signal.Signals(signum).name
            self._send()

    def _send(self) -> None:
        if self._target is None or self._sent:
            return
        self._sent = True
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(self._target), ctypes.py_object(Stopped)
        )

    def check(self) -> None:
        """Between the CLI's own start-up steps."""
        if self.received:
            raise Stopped(self.received)

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` in a thread that the signals stop; its result or its error."""
        outcome: list = []

        def body() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome.append((False, exc))

        thread = threading.Thread(target=body, name="rolloutflow-run")
        thread.start()
        self._target = thread.ident
        if self.received:  # a signal came while the thread started
            self._send()
        while thread.is_alive():
            thread.join(0.2)  # a timed join lets the handler run
        ok, value = outcome[0]
        if not ok:
            if isinstance(value, Stopped) and self.received:
                raise Stopped(self.received) from None
            raise value
        return value


def quiet_ray_signal_handlers() -> None:
    """No C++ stack dump on SIGTERM in this process: set before `ray` is
    imported (read once, by ray_constants), and only for this process: Ray's
    workers inherit the environment and keep their crash dumps."""
    os.environ[RAY_DISABLE_FAILURE_SIGNAL_HANDLER] = "1"
    import ray._private.ray_constants  # noqa: F401 - reads the switch

    del os.environ[RAY_DISABLE_FAILURE_SIGNAL_HANDLER]


#: Resolved here, in the parent: a child forked from a threaded process (Ray's
#: driver is) must not load libraries before exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent(parent: int) -> None:
    """preexec_fn of a child: SIGKILL when the parent dies, and no SIGINT
    (Ctrl-C reaches the whole process group; the CLI stops the run first and
    then its children)."""
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(127)
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


#: As Prefect's own ephemeral server: no UI, and of the background services
#: only those of an ephemeral server (the event pipeline that records task
#: runs). Turning off more of them (automations, the event stream out, block
#: registration) saved no measurable CPU (docs/history/benchmarks-diary.md).
EPHEMERAL = {"PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


class LocalPrefect:
    """A Prefect API server for one CLI run, a child of the CLI that dies
    with it. Its database lives in PREFECT_HOME, shared by the runs of a
    checkout (SQLite takes several servers; each has its own port).

    Its socket is bound here, so its URL is known before it runs: Prefect
    reads PREFECT_API_URL once, when it is imported; `start` runs it."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Run it (once; later calls do nothing)."""
        if self.process is not None:
            return
        parent = os.getpid()
        fd = self._sock.fileno()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "prefect.server.api.server:create_app",
                "--fd",
                str(fd),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env={**os.environ, **EPHEMERAL},
            pass_fds=(fd,),
            preexec_fn=lambda: _die_with_parent(parent),
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout_s: float) -> None:
        if self.process is None:
            raise RuntimeError("the local Prefect server was not started")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the local Prefect server exited with code {self.process.returncode}"
                )
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the local Prefect server did not answer within {timeout_s:g} s")

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM), without waiting: `stop` waits."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._sock.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


#: The reaper: waits for its stdin to close (the CLI died, however it died)
#: and SIGKILLs the processes it was given, each "pid:start time" so that a
#: reused pid is left alone.
_REAPER = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
sys.stdin.buffer.read()
for entry in sys.argv[1:]:
    pid, start = entry.split(":")
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[19] == start:
                os.kill(int(pid), signal.SIGKILL)
    except (OSError, IndexError):
        pass
"""


def descendants(root: int) -> list[int]:
    """The processes under `root` now, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def reap_on_death(pids: list[int]) -> subprocess.Popen | None:
    """Kill `pids` when this process dies, even by SIGKILL. For Ray's local
    agents (dashboard, runtime env): the raylet dies with its driver, but its
    agents first try to report that to the GCS, dead too, for up to 60 s."""
    entries = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                entries.append(f"{pid}:{f.read().rsplit(')', 1)[1].split()[19]}")
        except (OSError, IndexError):
            continue
    if not entries:
        return None
    return subprocess.Popen([sys.executable, "-S", "-c", _REAPER, *entries], stdin=subprocess.PIPE)
