"""The engine core's forkserver (engines/vllm/forkserver.py): a forked child finds
the preloaded modules imported, and dies with the process that started the
server, even when that process is killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from processes import alive
from waiting import wait_until

# Stands in for the engine actor: starts the server with a preload, forks a
# child from it that reports what it sees, then waits to be killed.
ACTOR = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    from engines.vllm import forkserver

    def report(path):
        pdeathsig = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
        seen = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "wave_preloaded": "wave" in sys.modules,
            "pdeathsig": pdeathsig.value,
        }
        with open(path + ".tmp", "w") as f:
            json.dump(seen, f)
        os.rename(path + ".tmp", path)
        time.sleep(600)

    if __name__ == "__main__":
        forkserver.start(("wave",))  # a module nothing else here imports
        forkserver.context().Process(target=report, args=(sys.argv[1],)).start()
        time.sleep(600)
    """
)


def test_forked_child_is_preloaded_and_dies_with_a_killed_actor(tmp_path):
    script = tmp_path / "actor.py"
    script.write_text(ACTOR)
    out = tmp_path / "child.json"
    actor = subprocess.Popen([sys.executable, str(script), str(out)], cwd=tmp_path)
    try:
        seen = wait_until(
            lambda: out.exists() and json.loads(out.read_text()),
            timeout_s=60,
            what="the forked child's report",
        )
        server = seen["ppid"]
        assert server != actor.pid, "the child was forked by the actor, not by the server"
        assert seen["wave_preloaded"], "the preload was not imported before the fork"
        assert seen["pdeathsig"] == signal.SIGKILL
        assert alive(seen["pid"]) and alive(server)
        actor.kill()  # SIGKILL: nothing in the actor runs
        actor.wait(timeout=10)
        wait_until(lambda: not alive(server), 30, "the server to exit with its actor")
        wait_until(lambda: not alive(seen["pid"]), 30, "the forked child to exit with the server")
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait(timeout=10)
        if out.exists():  # leave nothing behind if an assertion failed
            seen = json.loads(out.read_text())
            for pid in (seen["pid"], seen["ppid"]):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
