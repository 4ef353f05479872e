"""How a run reaches Ray: connect to its cluster, shipping the run's own code
in the job's `runtime_env`, or start a local Ray. Prefect-free, so the CLI
starts Ray before it imports Prefect (docs/history/benchmarks-diary.md).

Connecting to a cluster, the run ships its own code with the job's
`runtime_env` (`py_modules`): engines, the policy and vLLM's worker extension
(`engines.worker_extension...`, imported by name in vLLM's workers) then
import on nodes that never installed rolloutflow. A job-level runtime_env
reaches every actor of the job and their children (actors that set only
`env_vars` have them merged with it), so engines/ needs no change. A local Ray
started here runs workers on this machine with the project importable:
nothing is shipped (it only slows the first actor start).

Never `ray stop`: it ends every Ray process of the user on the machine, other
runs' included. A local Ray started here ends with `ray.shutdown()`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ray

from engines.env import RAY_ADDRESS

#: The project's packages, shipped to a cluster as `py_modules`.
PACKAGES = ("engines", "tasks", "flows", "training", "agents")
#: Never uploaded (gitignore syntax, relative to each package).
EXCLUDES = ["__pycache__/", "*.pyc"]
#: A local Ray starts no worker before it is asked for one: by default the
#: first driver gets one idle worker per CPU, which the run never uses (its
#: actors each start a worker of their own, for their runtime_env), and which
#: on a small machine take CPU from the engines' start.
LOCAL_RAY_CONFIG = {"prestart_worker_first_driver": False}
#: Set by Ray in the driver of a job (`ray job submit`): the job's config.
RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def code_runtime_env(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's runtime_env on a cluster: the project's packages as
    `py_modules`, with the user's `extra` merged in (its `py_modules` added
    to ours, its `excludes` to ours, any other field taken as given).

    Inside a Ray job whose own runtime_env already ships code (`ray job
    submit --working-dir .`), only `extra` is used: Ray merges the driver's
    runtime_env with the job's and refuses a field set by both."""
    extra = dict(extra or {})
    if shipped_by_job():
        return extra
    root = Path(__file__).resolve().parents[2]
    modules = [str(root / name) for name in PACKAGES]
    return {
        **extra,
        "py_modules": modules + list(extra.get("py_modules", [])),
        "excludes": EXCLUDES + list(extra.get("excludes", [])),
    }


def shipped_by_job() -> bool:
    job_config = json.loads(os.environ.get(RAY_JOB_CONFIG) or "{}")
    job_env = job_config.get("runtime_env") or {}
    return bool(job_env.get("working_dir") or job_env.get("py_modules"))


def connect(
    address: str | None,
    local_num_cpus: int,
    namespace: str,
    runtime_env: dict[str, Any] | None = None,
) -> bool:
    """Make sure this process is connected to Ray; True if it started a local Ray.
    `runtime_env`: the user's extra runtime_env for the run's job."""
    if ray.is_initialized():  # e.g. tests, or a caller that set Ray up itself
        return False
    target = address or os.environ.get(RAY_ADDRESS)
    if target:
        ray.init(address=target, namespace=namespace, runtime_env=code_runtime_env(runtime_env))
        return False
    # Logical CPUs: each engine holds one bundle CPU but CPU engines are small;
    # a 2-core laptop must still fit a few of them.
    ray.init(
        address="local",
        num_cpus=local_num_cpus,
        include_dashboard=False,
        namespace=namespace,
        runtime_env=runtime_env or None,
        _system_config=dict(LOCAL_RAY_CONFIG),  # ray.init adds to it
    )
    return True
