"""Prefect tasks of weight sync: connect the policy to the engines once, then
push the policy's weights between iterations (a `SyncReport` per sync for
the run's table: version, bytes, seconds, GB/s).

An engine's death never ends a sync: a failed engine is replaced before the
sync (as before a generation's try), one that dies under it is found and
marked failed, and the task's retry replaces it and syncs again; the run
fails only when no engine can be had in its place."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.client import get
from engines.errors import EngineDeadError, EngineFailure
from engines.weight_sync import SyncReport
from engines.weight_sync.errors import WeightSyncError
from tasks.engines import mark_unhealthy, replacing_failed, retry_on_engine_failure
from tasks.run.pool import EnginePool


@task(cache_policy=NO_CACHE, persist_result=False)
def init_weight_sync(
    policy: Any, engines: list[Any], *, timeout_s: float = 120.0, **options: Any
) -> dict[str, Any]:
    """Connect the policy to `engines` (for the broadcast transport: build the
    process group). `options` override the policy config's transport settings."""
    logger = get_run_logger()
    info = get(policy.init_weight_sync.remote(engines, **options), timeout_s, "policy")
    logger.info("weight sync ready: %s", info)
    return info


def push_weights(
    policy: Any, pool: EnginePool, timeout_s: float, *, connect: bool, reconnect: bool
) -> SyncReport:
    """The policy's current weights to the pool's engines; `connect`: first
    connect the policy to them, `reconnect`: some were replaced in place.
    When it fails and engines are found dead (`mark_unhealthy`), raises
    `EngineDeadError` naming them: the caller's retry replaces them. Other
    failures are raised as they are."""
    try:
        if connect:
            init_weight_sync.fn(policy, list(pool.engines), timeout_s=timeout_s)
        sync = policy.sync_weights.remote(list(pool.engines), reconnect=reconnect and not connect)
        return get(sync, timeout_s, "policy")
    except (EngineFailure, WeightSyncError) as exc:
        dead = mark_unhealthy(pool)
        if not dead:
            raise
        raise EngineDeadError(f"engines {dead} died under the weight sync: {exc}", dead[0]) from exc


@task(cache_policy=NO_CACHE, persist_result=False, retry_condition_fn=retry_on_engine_failure)
def sync_weights(
    policy: Any,
    pool: EnginePool,
    *,
    iteration: int,
    timeout_s: float = 600.0,
    ready_timeout_s: float = 600.0,
    connect: bool = False,
    router: Any = None,
) -> SyncReport:
    """Push the policy's current weights to the pool's engines; `connect`:
    first connect the policy to them (`init_weight_sync`). Failed engines
    are replaced first (up within `ready_timeout_s`; an agent run's `router`
    then routes to them) and synced with the others. Returns the policy's
    report, with `iteration` set. Raises `EngineDeadError` when an engine
    died under it (the flow retries the task), else `WeightSyncError`."""
    logger = get_run_logger()
    with replacing_failed(pool, ready_timeout_s, router) as replaced:
        report = push_weights(policy, pool, timeout_s, connect=connect, reconnect=bool(replaced))
    if report.skipped:
        logger.info("iteration %d: engines already serve version %d", iteration, report.version)
    else:
        logger.info(
            "iteration %d: synced version %d, %d bytes in %.3fs (%.3f GB/s)",
            iteration,
            report.version,
            report.bytes,
            report.seconds,
            report.gb_per_s,
        )
    return replace(report, iteration=iteration)
