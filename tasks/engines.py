"""Tasks that create, check and tear down the run's engines."""

from __future__ import annotations

import time

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines import EngineFailure, EngineTimeoutError, create_vllm_engines, destroy_engines
from engines.client import get
from tasks.cluster import Cluster
from tasks.pool import EnginePool
from tasks.scope import RunScope, sweep_run

# A result that `ray.wait` reported ready is fetched at once; the deadline only
# guards against a pathological object store.
FETCH_TIMEOUT_S = 30.0


def retry_on_engine_failure(task, task_run, state) -> bool:
    """`retry_condition_fn`: retry only when an engine died or hung; bad input,
    a rejected request or a bug fails at once."""
    return isinstance(state.result(raise_on_failure=False), EngineFailure)


@task(cache_policy=NO_CACHE, persist_result=False)
def resolve_model(model: str | None) -> str:
    """The model directory; the tiny test model (built once) when none is given."""
    if model:
        return model
    from engines.tiny_model import ensure_tiny_model  # builds with torch, on first use only

    path = str(ensure_tiny_model())
    get_run_logger().info("no model given: using the tiny test model at %s", path)
    return path


@task(cache_policy=NO_CACHE, persist_result=False)
def create_engines(
    *,
    scope: RunScope,
    cluster: Cluster,
    model: str,
    num_engines: int,
    tensor_parallel_size: int,
    max_len: int,
    gpu_memory_utilization: float,
    seed: int,
    engine_kwargs: dict | None = None,
    spare_engines: int = 0,
) -> EnginePool:
    """Start the engines, and `spare_engines` warm spares (returns at once;
    `wait_until_ready` waits for them)."""
    engines = create_vllm_engines(
        num_engines,
        model,
        max_len,
        gpu_memory_utilization,
        tensor_parallel_size,
        seed,
        backend=cluster.backend,
        name_prefix=scope.name_prefix,
        namespace=scope.namespace,
        spare_engines=spare_engines,
        **(engine_kwargs or {}),
    )
    get_run_logger().info("starting %s in namespace %s", engines.names, engines.namespace)
    return EnginePool(engines)


def wait_ready(pool: EnginePool, timeout_s: float) -> None:
    """Wait, in parallel and under one deadline, for every engine not known
    to be ready; record each one's start-up time. The first engine that fails
    is marked failed and its own error raised."""
    pending = {pool.engines[i].ready.remote(): i for i in range(len(pool)) if i not in pool.ready}
    deadline = time.monotonic() + timeout_s
    while pending:
        done, _ = ray.wait(
            list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
        )
        if not done:
            late = sorted(pending.values())
            for index in late:
                pool.mark_failed(
                    index, EngineTimeoutError(f"not ready within {timeout_s:g}s", pool.name(index))
                )
            problem = pool.placement_problem()
            raise EngineTimeoutError(
                f"engines {[pool.name(i) for i in late]} were not ready within {timeout_s:g}s"
                + (f"; {problem}" if problem else ""),
                pool.name(late[0]),
            )
        for ref in done:
            index = pending.pop(ref)
            try:
                get(ref, FETCH_TIMEOUT_S, pool.name(index))
            except EngineFailure as exc:
                pool.mark_failed(index, exc)
                raise
            pool.ready.add(index)
            pool.stats[index].startup_s = round(time.monotonic() - pool.started_at[index], 2)


@task(
    cache_policy=NO_CACHE,
    persist_result=False,
    retry_condition_fn=retry_on_engine_failure,
)
def wait_until_ready(pool: EnginePool, timeout_s: float) -> dict[str, float | None]:
    """Readiness health check of every engine; returns start-up seconds per engine."""
    logger = get_run_logger()
    with pool.replacement(logger, timeout_s, wait_s=timeout_s):
        wait_ready(pool, timeout_s)
    startup = {s.name: s.startup_s for s in pool.stats}
    logger.info("engines ready; start-up seconds: %s", startup)
    if pool.engines.spares:
        # Started with the engines, so this costs little more than their start.
        pool.wait_spares(logger, timeout_s)
        logger.info("spares asleep: %s", [s.config.name for s in pool.engines.spares])
    return startup


@task(cache_policy=NO_CACHE, persist_result=False)
def teardown(pool: EnginePool | None, scope: RunScope, cluster: Cluster, policy=None) -> None:
    """Stop the run's engines (by handle, then by name: a replaced engine's
    predecessor or an earlier attempt's leftovers too), its policy actor and
    a local Ray started for the run."""
    logger = get_run_logger()
    try:
        if policy is not None:
            ray.kill(policy, no_restart=True)
        if pool is not None:
            destroy_engines(pool.engines)
        swept = sweep_run(scope.run_id)
        logger.info(
            "engines of run %s stopped%s", scope.run_id, f" (swept {swept})" if swept else ""
        )
    finally:
        if cluster.started_here:
            ray.shutdown()
