"""The runtime_env a run gives its job on a cluster, and the local Ray a run
starts (tasks/run/connection.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import engines
from tasks.run.connection import EXCLUDES, PACKAGES, RAY_JOB_CONFIG, code_runtime_env

ROOT = Path(engines.__file__).resolve().parents[1]


def test_ships_the_projects_packages(monkeypatch):
    monkeypatch.delenv(RAY_JOB_CONFIG, raising=False)
    env = code_runtime_env()
    assert env["py_modules"] == [str(ROOT / name) for name in PACKAGES]
    assert all((Path(path) / "__init__.py").is_file() for path in env["py_modules"])
    assert env["excludes"] == EXCLUDES


def test_merges_the_users_runtime_env(monkeypatch):
    monkeypatch.delenv(RAY_JOB_CONFIG, raising=False)
    extra = {
        "py_modules": ["/opt/rewards"],
        "excludes": ["*.ckpt"],
        "env_vars": {"HF_HOME": "/data/hf"},
        "pip": ["math-verify"],
    }
    env = code_runtime_env(extra)
    assert env["py_modules"] == [str(ROOT / name) for name in PACKAGES] + ["/opt/rewards"]
    assert env["excludes"] == EXCLUDES + ["*.ckpt"]
    assert env["env_vars"] == {"HF_HOME": "/data/hf"}
    assert env["pip"] == ["math-verify"]
    assert extra["py_modules"] == ["/opt/rewards"]  # the caller's dict is left alone


def test_inside_a_job_that_ships_code_only_the_extra(monkeypatch):
    """`ray job submit --working-dir .`: the job ships the code already, and
    Ray refuses a field that both the job and the driver set."""
    job = {"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip"}}
    monkeypatch.setenv(RAY_JOB_CONFIG, json.dumps(job))
    assert code_runtime_env({"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    assert code_runtime_env() == {}


def test_inside_a_job_without_code_ships_it(monkeypatch):
    monkeypatch.setenv(RAY_JOB_CONFIG, json.dumps({"runtime_env": {"env_vars": {"A": "1"}}}))
    assert "py_modules" in code_runtime_env()


def test_a_local_ray_prestarts_no_worker(tmp_path):
    """`connect` without an address starts a local Ray whose raylet starts
    workers only on demand (as the raylet reports its config)."""
    code = (
        "import ray\n"
        "from tasks.run.connection import connect\n"
        "assert connect(None, 2, 'test-cluster')\n"
        "print(ray._private.state.state.get_system_config()['prestart_worker_first_driver'])\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "PREFECT_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "False", done.stdout
