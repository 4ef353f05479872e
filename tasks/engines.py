"""Tasks that create, check and tear down the run's engines."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines import (
    EngineFailure,
    EngineSet,
    EngineSetSpec,
    EngineTimeoutError,
    destroy_engines,
    start_engine_set,
)
from engines.client import collect, get
from tasks.cluster import Cluster
from tasks.run.params import EngineParams
from tasks.run.pool import FETCH_TIMEOUT_S, EnginePool
from tasks.run.scope import RunScope, sweep_run

#: Deadline for an engine's health: an answer from its event loop, no engine step.
HEALTH_TIMEOUT_S = 30.0


def retry_on_engine_failure(task, task_run, state) -> bool:
    """`retry_condition_fn`: retry only when an engine died or hung; bad input,
    a rejected request or a bug fails at once."""
    return isinstance(state.result(raise_on_failure=False), EngineFailure)


def model_path(model: str | None) -> str:
    """The model directory; the tiny test model (built once) when none is given."""
    if model:
        return model
    from engines.tiny_model import ensure_tiny_model  # builds with torch, on first use only

    return str(ensure_tiny_model())


@task(cache_policy=NO_CACHE, persist_result=False)
def resolve_model(model: str | None) -> str:
    """The model directory; the tiny test model (built once) when none is given."""
    path = model_path(model)
    if not model:
        get_run_logger().info("no model given: using the tiny test model at %s", path)
    return path


def engine_spec(engines: EngineParams, **decided: Any) -> EngineSetSpec:
    """The engine set of a run's engine section: every field the spec names
    passes on as it is, so a new engine knob needs no edit here. `decided`:
    what the run resolved (pretrain, backend) or takes from its other
    sections (seed, placement)."""
    given = {
        name: value
        for name, value in engines.model_dump().items()
        if name in EngineSetSpec.model_fields
    }
    return EngineSetSpec(**{**given, **decided})


@dataclass(frozen=True)
class EarlyEngines:
    """A run's engines started before its flow: the CLI starts them on the
    local Ray it started, while Prefect's server comes up, and passes them to
    the flow. Their names are their own (the flow run's id is not known
    yet); they end with that local Ray."""

    spec: EngineSetSpec
    engines: EngineSet
    started_at: float  # time.monotonic() when they were created


def same_but_key(a: EngineSetSpec, b: EngineSetSpec) -> bool:
    return a.model_copy(update={"openai_api_key": None}) == b.model_copy(
        update={"openai_api_key": None}
    )


def start_early(spec: EngineSetSpec) -> EarlyEngines:
    return EarlyEngines(spec, start_engine_set(spec), time.monotonic())


def take_early(early: EarlyEngines | None, spec: EngineSetSpec) -> EarlyEngines | None:
    """`early` if they are what `spec` asks for; others are destroyed. The
    endpoint's token is each spec's own draw: the early engines keep theirs
    (read it from `EngineSet.api_key`)."""
    if early is None or same_but_key(early.spec, spec):
        return early
    destroy_engines(early.engines)
    return None


@task(cache_policy=NO_CACHE, persist_result=False)
def create_engines(
    *, scope: RunScope, spec: EngineSetSpec, early: EarlyEngines | None = None
) -> EnginePool:
    """Start the engines, and `spec.spare_engines` warm spares (returns at
    once; `wait_until_ready` waits for them), named for the run, or take
    `early` (the CLI's) when they are what `spec` asks for; others are
    destroyed."""
    logger = get_run_logger()
    if early := take_early(early, spec):
        logger.info(
            "using %s, started %.1f s ago while Prefect came up",
            early.engines.names,
            time.monotonic() - early.started_at,
        )
        return EnginePool(early.engines, started_at=early.started_at)
    engines = start_engine_set(
        spec.model_copy(update={"name_prefix": scope.name_prefix, "namespace": scope.namespace})
    )
    logger.info("starting %s in namespace %s", engines.names, engines.namespace)
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
            if pool.engines.configs[index].openai_api:  # started by `ready`; a new one's may move
                url = pool.engines[index].openai_url.remote()
                pool.stats[index].openai_url = get(url, FETCH_TIMEOUT_S, pool.name(index))


@contextmanager
def replacing_failed(pool: EnginePool, timeout_s: float, router: Any = None) -> Iterator[list[int]]:
    """Replace the pool's failed engines (`EnginePool.replace_failed`: a warm
    spare, a restart in the engine's actor, or a new actor) and wait until
    they are up; yields their indices to the body, which syncs them to the
    policy's weights. Then an agent run's `router` routes to them, and they
    serve. One task at a time: another waits, then finds them replaced. When
    no engine can be had in place of a failed one, the error says which and why."""
    logger = get_run_logger()
    lost, replacing = [pool.name(i) for i in sorted(pool.failed)], True
    try:
        with pool.replacement(logger, timeout_s, 3 * timeout_s) as replaced:
            if replaced:
                wait_ready(pool, timeout_s)
            replacing = False
            yield replaced
            if replaced and router is not None:
                names = get(router.set_engines.remote(list(pool.engines), timeout_s), timeout_s)
                logger.info("the router routes to %s", names)
    except EngineFailure as exc:
        if not replacing:
            raise
        raise type(exc)(f"no engine could take the place of {lost}: {exc}", exc.engine) from exc


def mark_unhealthy(pool: EnginePool, timeout_s: float = HEALTH_TIMEOUT_S) -> list[str]:
    """After a call over every engine failed (a weight sync): ask each engine
    still counted live for its health, and mark failed those that are dead
    or do not answer, so the next try replaces them. Returns their names."""
    live = pool.live()
    restarts = [pool.stats[i].restarts for i in live]
    names = [pool.name(i) for i in live]
    results = collect([pool.engines[i].health.remote() for i in live], names, "health", timeout_s)
    dead = []
    for index, count, result in zip(live, restarts, results, strict=True):
        if isinstance(result.error, EngineFailure):
            pool.mark_failed(index, result.error, count)
            dead.append(pool.name(index))
    return dead


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
    if pool.engines.api_key:
        urls = {s.name: s.openai_url for s in pool.stats}
        logger.info("engines' OpenAI endpoints (bearer token: the run's): %s", urls)
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
