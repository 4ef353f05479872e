"""The engine core's forkserver (engines/vllm/forkserver.py): a forked child finds
the preloaded modules imported and the actor's environment as at the fork
(not the server's from its start), the actor knows how long its fork waited
for them, and the child dies with the process that started the server, even when
that process is killed with SIGKILL; the server, exiting, removes that process's
multiprocessing folder (its socket's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from processes import alive
from waiting import wait_until

#: How long one preloaded module takes to import.
SLOW_IMPORT_S = 1.0

# Stands in for the engine actor: starts the server with a preload (one slow
# to import), forks a child from it that reports what it sees, writes how
# long that fork waited, then waits to be killed.
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
            "wave_preloaded": "wave" in sys.modules and "slow_import" in sys.modules,
            "pdeathsig": pdeathsig.value,
            "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        with open(path + ".tmp", "w") as f:
            json.dump(seen, f)
        os.rename(path + ".tmp", path)
        time.sleep(600)

    if __name__ == "__main__":
        forkserver.start(("wave", "slow_import"))  # modules nothing else here imports
        os.environ["CUDA_VISIBLE_DEVICES"] = "7"  # set after the server started, as adopt() does
        forkserver.context().Process(target=report, args=(sys.argv[1],)).start()
        with open(sys.argv[1] + ".waits.tmp", "w") as f:
            json.dump(forkserver.fork_waits, f)
        os.rename(sys.argv[1] + ".waits.tmp", sys.argv[1] + ".waits")
        time.sleep(600)
    """
)


def test_forked_child_is_preloaded_and_dies_with_a_killed_actor(tmp_path):
    script = tmp_path / "actor.py"
    script.write_text(ACTOR)
    (tmp_path / "slow_import.py").write_text(f"import time\ntime.sleep({SLOW_IMPORT_S})\n")
    out = tmp_path / "child.json"
    # The actor's multiprocessing folder (pymp-*, the server's socket) here.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    actor = subprocess.Popen([sys.executable, str(script), str(out)], cwd=tmp_path, env=env)
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
        assert seen["gpu"] == "7", "the child has the server's environment, not the actor's"
        # The fork came only after the server's preload, the slow import included.
        waits_file = Path(f"{out}.waits")
        wait_until(waits_file.exists, timeout_s=30, what="the actor's fork waits")
        waits = json.loads(waits_file.read_text())
        # (the actor asked for its fork a moment after the server began)
        assert len(waits) == 1 and waits[0] >= 0.9 * SLOW_IMPORT_S, waits
        assert alive(seen["pid"]) and alive(server)
        actor.kill()  # SIGKILL: nothing in the actor runs
        actor.wait(timeout=10)
        wait_until(lambda: not alive(server), 30, "the server to exit with its actor")
        wait_until(lambda: not alive(seen["pid"]), 30, "the forked child to exit with the server")
        assert not list(tmp_path.glob("pymp-*")), "the server left the killed actor's folder"
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait(timeout=10)
        if out.exists():  # leave nothing behind if an assertion failed
            seen = json.loads(out.read_text())
            for pid in (seen["pid"], seen["ppid"]):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
