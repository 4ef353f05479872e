"""The leak guard fails a module that leaves an actor, a placement group or a
process, names the module and each thing, ends them; it does not blame a
clean module for what session fixtures started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

CONFTEST = """
import pytest, ray
from leak_guard import GUARD, _leak_guard, pytest_fixture_setup

GUARD.deadline_s = 10  # the leaks here never end on their own

@ray.remote(num_cpus=0)
class Holder:
    def pid(self):
        import os
        return os.getpid()

@pytest.fixture(scope="session")
def cluster():
    # Its raylet, workers and this actor live for the session: not a leak.
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    kept = Holder.options(name="session-holder").remote()
    ray.get(kept.pid.remote(), timeout=120)
    yield kept
    ray.shutdown()
"""

LEAKY = """
import subprocess, ray
from conftest import Holder

@ray.remote(num_cpus=1)
def sleeper():
    import time
    time.sleep(1200)


held = []  # a handle kept past the test: Ray ends an actor once none is left


def test_leaks_an_actor_a_group_and_a_process(cluster):
    held.append(Holder.options(name="leaky-holder").remote())
    ray.get(held[0].pid.remote(), timeout=120)
    group = ray.util.placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=120)
    subprocess.Popen(["sleep", "1234"])
    sleeper.remote()  # a task still running: it holds a CPU
"""

CLEAN = """
import subprocess, ray
from conftest import Holder

def test_ends_what_it_starts(cluster):
    holder = Holder.remote()
    ray.get(holder.pid.remote(), timeout=120)
    ray.kill(holder)
    group = ray.util.placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=120)
    ray.util.remove_placement_group(group)
    subprocess.run(["true"], check=True)
"""


def test_the_guard_names_the_leaking_module_and_what_it_left(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a_leaky.py").write_text(LEAKY)
    (tmp_path / "test_b_clean.py").write_text(CLEAN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(tmp_path)])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 passed, 1 error" in out, out
    assert "ERROR at teardown of test_leaks_an_actor_a_group_and_a_process" in out, out
    assert "test_a_leaky left behind" in out, out
    left = out.split("test_a_leaky left behind")[1].split("-----")[0]
    assert "actor Holder 'leaky-holder'" in left, out
    assert "bundles [{'CPU': 1.0}]" in left, out
    assert "sleep 1234" in left, out
    assert "task sleeper" in left, out
    # Nothing else is blamed: not the session's actor or cluster, nor the clean module.
    assert "session-holder" not in left, out
    assert "raylet" not in left, out
    assert "test_b_clean left behind" not in out, out
