"""Provision the Ray cluster for a run: reuse this process's connection,
connect to an existing cluster, or start a local one (`tasks.connection`);
then check that it can hold the engines before anything is created on it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.errors import EngineSpecError
from engines.placement import check_cluster_fits
from engines.vllm_engine import resolve_backend
from tasks.connection import connect
from tasks.scope import RunScope, sweep_run


@dataclass(frozen=True)
class Cluster:
    #: GCS address: a hook in another process reconnects here.
    address: str
    #: A local Ray this process started: the run shuts it down at the end.
    started_here: bool
    #: The engine backend the cluster supports ("vllm" or "hf").
    backend: str


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
    colocate: bool = False,
    runtime_env: dict[str, Any] | None = None,
) -> Cluster:
    """Start or connect to Ray; check that the engines (and the policy of an
    on-policy run: one more GPU, or CPU; `colocate`: one GPU holds them all)
    fit before anything is created."""
    logger = get_run_logger()
    needed = num_engines * tensor_parallel_size + int(with_policy)
    started = connect(
        address,
        local_num_cpus or max(os.cpu_count() or 1, needed),
        scope.namespace,
        runtime_env,
    )
    try:
        chosen = resolve_backend(backend)
        check_cluster_fits(
            1 if colocate else num_engines,
            tensor_parallel_size,
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
