"""Provision the Ray cluster for a run: reuse this process's connection,
connect to an existing cluster, or start a local one (`tasks.run.connection`);
then check that it can hold the engines before anything is created on it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines import EngineSpecError, check_cluster_fits, resolve_backend
from tasks.run.connection import connect
from tasks.run.params import ClusterParams, EngineParams
from tasks.run.scope import RunScope, sweep_run


@dataclass(frozen=True)
class Cluster:
    #: GCS address: a hook in another process reconnects here.
    address: str
    #: A local Ray this process started: the run shuts it down at the end.
    started_here: bool
    #: The engine backend the cluster supports ("vllm" or "hf").
    backend: str


def local_num_cpus(cluster: ClusterParams, engines: EngineParams, with_policy: bool) -> int:
    """Logical CPUs of a local Ray: the run's, else enough for the engines,
    their spares and the policy (the CLI starts Ray with the same)."""
    needed = (engines.num_engines + engines.spare_engines) * engines.tensor_parallel_size
    return cluster.local_num_cpus or max(os.cpu_count() or 1, needed + int(with_policy))


@task(cache_policy=NO_CACHE, persist_result=False)
def provision_cluster(
    *,
    scope: RunScope,
    cluster: ClusterParams,
    engines: EngineParams,
    with_policy: bool = False,
    colocate: bool = False,
) -> Cluster:
    """Start or connect to Ray; check that the engines and their spares (and
    the policy of an on-policy run: one more GPU, or CPU; `colocate`: one GPU
    holds them all) fit before anything is created."""
    logger = get_run_logger()
    num_engines = engines.num_engines + engines.spare_engines
    needed = num_engines * engines.tensor_parallel_size + int(with_policy)
    cpus = local_num_cpus(cluster, engines, with_policy)
    started = connect(cluster.address, cpus, scope.namespace, cluster.runtime_env)
    try:
        chosen = resolve_backend(engines.backend)
        check_cluster_fits(
            1 if colocate else num_engines,
            engines.tensor_parallel_size,
            uses_gpu=ray.cluster_resources().get("GPU", 0) > 0,
        )
        if with_policy and not colocate:
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
