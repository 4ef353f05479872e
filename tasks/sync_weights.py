"""Prefect tasks of weight sync: connect the policy to the engines once, then
push the policy's weights between iterations (a `SyncReport` per sync for
the run's table: version, bytes, seconds, GB/s)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.client import get
from engines.weight_sync import SyncReport


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


@task(cache_policy=NO_CACHE, persist_result=False)
def sync_weights(
    policy: Any,
    engines: list[Any],
    *,
    iteration: int,
    timeout_s: float = 600.0,
    connect: bool = False,
) -> SyncReport:
    """Push the policy's current weights to `engines` (pass the pool's current
    handles: replaced engines are reconnected and synced); `connect`: first
    connect the policy to them (`init_weight_sync`). Returns the policy's
    report, with `iteration` set. Raises `WeightSyncError` (recoverable:
    retry) or `EngineDeadError`."""
    logger = get_run_logger()
    if connect:
        init_weight_sync.fn(policy, engines, timeout_s=timeout_s)
    report = get(policy.sync_weights.remote(engines), timeout_s, "policy")
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
