"""vLLM's engine core forked from a server that imported vLLM beside the
actor, instead of spawned from scratch.

Inside a Ray actor vLLM always spawns its engine-core process
(`_maybe_force_spawn` in vllm/utils/system_utils.py, v0.26.0: a Ray worker's
gRPC threads make forking it unsafe), and the spawned process imports vLLM
all over again, after the actor has: a part of every engine start that
plain `vllm.LLM`, which forks, never pays. A forkserver is a fresh process,
not a fork of the Ray worker. Started first thing in the actor, it imports the
engine core's modules while the actor imports its own, and then forks the
engine core in milliseconds. vLLM's API server does the same with
`VLLM_WORKER_MULTIPROC_METHOD=forkserver` (entrypoints/openai/api_server.py).

Lifetime: the server is the actor's child and exits when the actor is gone
(its "alive" pipe closes, however the actor died); each process it forks
drops its copy of that pipe and is killed when the server exits
(PR_SET_PDEATHSIG). So an engine core never outlives its actor, even one
killed with SIGKILL or by a crash, which Ray's own clean-up does not cover for
grandchildren: https://docs.ray.io/en/latest/ray-core/user-spawn-processes.html
The server's socket is in the actor's multiprocessing folder (/tmp/pymp-*),
which multiprocessing removes at a normal exit only, and every teardown
kills the actor: the server removes that folder as it exits.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import shutil
import signal
import time
from multiprocessing import context as mp_context
from multiprocessing import forkserver
from multiprocessing import util as mp_util

_PR_SET_PDEATHSIG = 1

#: "<actor pid>:<its multiprocessing folder>", set by `start` for the server
#: it spawns, which imports this module (its preload).
_FOLDER_ENV = "ROLLOUTFLOW_FORKSERVER_FOLDER"

#: Seconds each fork from this process's server took to start. The server
#: forks only once it has imported its preload, so a long one is the part of
#: that import the actor's own imports did not hide (the start-up report
#: shows the last, `StartupReport.fork_wait_s`).
fork_waits: list[float] = []


def start(preload: tuple[str, ...]) -> None:
    """Start this process's forkserver, importing `preload` in it while this
    process goes on; a no-op once it runs."""
    # "__main__" (the Ray worker's script) as the spawned engine core imported
    # it; this module for TiedProcess, which each forked child unpickles.
    multiprocessing.set_forkserver_preload(["__main__", __name__, *preload])
    os.environ[_FOLDER_ENV] = f"{os.getpid()}:{mp_util.get_temp_dir()}"
    forkserver.ensure_running()


def _remove_folder_at_exit() -> None:
    """In the server (the actor's child; not the engine cores it forks,
    nor what they start): remove the actor's folder when the server exits."""
    actor, _, folder = os.environ.get(_FOLDER_ENV, "").partition(":")
    if folder and actor == str(os.getppid()):
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


_remove_folder_at_exit()


class TiedProcess(mp_context.ForkServerProcess):
    """A forkserver child that dies with the server, and so with the process
    that started the server."""

    def start(self) -> None:
        began = time.monotonic()
        forkserver.ensure_running()
        # The parent the child must have (multiprocessing's own record of it).
        self._server_pid = forkserver._forkserver._forkserver_pid
        # The child takes this process's environment as it is now, as a
        # spawned one would, not the server's from its start: a prepared
        # actor sets its GPU after (engines.lifecycle.prepared).
        self._environ = dict(os.environ)
        super().start()  # returns with the child's pid, once it is forked
        fork_waits.append(time.monotonic() - began)

    def run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != self._server_pid:  # the server exited before prctl
            os._exit(1)
        # Every forked child inherits a write end of the server's alive pipe;
        # one held here would keep the server, and so this process, alive
        # after the actor is gone.
        alive_fd = forkserver._forkserver._forkserver_alive_fd
        if alive_fd is not None:
            os.close(alive_fd)
            forkserver._forkserver._forkserver_alive_fd = None
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class TiedContext(mp_context.ForkServerContext):
    Process = TiedProcess


_CONTEXT = TiedContext()


def context() -> TiedContext:
    """A multiprocessing context whose processes fork from the server started
    by `start` (the same signature as vLLM's `get_mp_context`)."""
    return _CONTEXT
