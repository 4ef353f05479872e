"""The runtime_env a run gives its job on a cluster (tasks/cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path

import engines
from tasks.cluster import EXCLUDES, PACKAGES, RAY_JOB_CONFIG, code_runtime_env

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
