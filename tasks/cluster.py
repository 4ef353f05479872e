"""Provision the Ray cluster for a run: reuse this process's connection,
connect to an existing cluster, or start a local one; then check that it can
hold the engines before anything is created on it.

Never `ray stop`: it ends every Ray process of the user on the machine, other
runs' included. A local Ray started here ends with `ray.shutdown()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.env import RAY_ADDRESS
from engines.errors import EngineSpecError
from engines.placement import check_cluster_fits
from engines.vllm_engine import resolve_backend
from tasks.scope import RunScope, sweep_run


@dataclass(frozen=True)
class Cluster:
    #: GCS address: a hook in another process reconnects here.
    address: str
    #: A local Ray this process started: the run shuts it down at the end.
    started_here: bool
    #: The engine backend the cluster supports ("vllm" or "hf").
    backend: str


def connect(address: str | None, local_num_cpus: int, namespace: str) -> bool:
    """Make sure this process is connected to Ray; True if it started a local Ray."""
    if ray.is_initialized():  # e.g. tests, or a caller that set Ray up itself
        return False
    target = address or os.environ.get(RAY_ADDRESS)
    if target:
        ray.init(address=target, namespace=namespace)
        return False
    # Logical CPUs: each engine holds one bundle CPU but CPU engines are small;
    # a 2-core laptop must still fit a few of them.
    ray.init(address="local", num_cpus=local_num_cpus, include_dashboard=False, namespace=namespace)
    return True


@task(cache_policy=NO_CACHE, persist_result=False)
def provision_cluster(
    *,
    scope: RunScope,
    address: str | None,
    local_num_cpus: int | None,
    backend: str,
    num_engines: int,
    tensor_parallel_size: int,
    with_policy: bool = False,
) -> Cluster:
    """Start or connect to Ray; check that the engines (and the policy of an
    on-policy run: one more GPU, or CPU) fit before anything is created."""
    logger = get_run_logger()
    needed = num_engines * tensor_parallel_size + int(with_policy)
    started = connect(address, local_num_cpus or max(os.cpu_count() or 1, needed), scope.namespace)
    try:
        chosen = resolve_backend(backend)
        check_cluster_fits(
            num_engines, tensor_parallel_size, uses_gpu=ray.cluster_resources().get("GPU", 0) > 0
        )
        if with_policy:
            resource = "GPU" if chosen == "vllm" else "CPU"
            have = ray.cluster_resources().get(resource, 0)
            if have < needed:
                raise EngineSpecError(
                    f"the policy needs a {resource} beside the engines' "
                    f"{needed - 1}: {needed} in all, but the cluster has {have:g}"
                )
        # A UI "Retry" runs the flow again under the same run id: whatever an
        # earlier attempt left (a killed process cannot clean up) is removed.
        leftovers = sweep_run(scope.run_id)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    if leftovers:
        logger.warning("removed leftovers of earlier attempts of this run: %s", leftovers)
    gcs = ray.get_runtime_context().gcs_address
    logger.info(
        "Ray at %s (%s), backend %r, resources %s",
        gcs,
        "started here" if started else "connected",
        chosen,
        {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")},
    )
    return Cluster(address=gcs, started_here=started, backend=chosen)
