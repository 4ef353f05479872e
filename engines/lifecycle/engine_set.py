"""The life of an engine set, whichever the backend: start it from its spec
(`start_engine_set`), restart or replace one engine, destroy the set. The
set itself (`EngineSet`) is `engines.lifecycle.handles`'s; its spares start
and swap in by `engines.lifecycle.spares`, its prepared actors start and
take a lost engine's place by `engines.lifecycle.prepared`.

Everything is checked before anything is created: bad input raises
`EngineSpecError` naming the bad value and leaves no actor or placement group.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from engines import env, naming
from engines.client import call_engines, get, raise_first_error
from engines.config import EngineConfig
from engines.errors import (
    BackendUnavailableError,
    EngineDeadError,
    EngineFailure,
    EngineSpecError,
    EngineTimeoutError,
)
from engines.lifecycle.actors import backend_class, kill, start_engine
from engines.lifecycle.handles import EngineSet
from engines.lifecycle.placement import EnginePlacement, remove_named_groups
from engines.lifecycle.prepared import start_prepared
from engines.lifecycle.spares import start_spare
from engines.lifecycle.spec import EngineSetSpec

logger = logging.getLogger(__name__)


def resolve_backend(backend: str) -> str:
    has_vllm = importlib.util.find_spec("vllm") is not None
    gpus = ray.cluster_resources().get("GPU", 0)
    if backend == "auto":
        chosen = "vllm" if has_vllm and gpus > 0 else "hf"
        logger.info(
            "backend='auto' chose %r (vLLM %s, %g GPUs in the cluster)",
            chosen,
            "installed" if has_vllm else "not installed",
            gpus,
        )
        return chosen
    if backend == "vllm" and not has_vllm:
        raise BackendUnavailableError(
            "backend='vllm' but vLLM is not installed: pip install 'rolloutflow[vllm]', "
            "or use backend='hf' (CPU)"
        )
    if backend == "vllm" and gpus == 0:
        raise BackendUnavailableError("backend='vllm' but the Ray cluster has no GPUs")
    return backend


def existing_engine_names(name_prefix: str, namespace: str) -> list[str]:
    pattern = naming.engine_name_pattern(re.escape(name_prefix))
    return sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace and pattern.match(actor["name"])
    )


def ensure_ray() -> None:
    if not ray.is_initialized():
        address = os.environ.get(env.RAY_ADDRESS, "local")
        logger.info("Ray is not initialised: ray.init(address=%r)", address)
        ray.init(address=address)


def on_this_cluster(spec: EngineSetSpec) -> EngineSetSpec:
    """`spec` with its backend chosen for this cluster and each engine's
    arguments completed for it: what can only be checked once the backend is
    known is checked here, still before anything exists."""
    backend = resolve_backend(spec.backend)
    engines = spec.num_engines + spec.spare_engines
    spec.placement.check(engines, spec.tensor_parallel_size, spec.gpu_memory_utilization, backend)
    kwargs = spec.engine_kwargs_for(backend)
    namespace = spec.namespace or ray.get_runtime_context().namespace
    name_prefix = spec.name_prefix or naming.unique_prefix()
    taken = existing_engine_names(name_prefix, namespace)
    if taken:
        raise EngineSpecError(
            f"engines named {taken} already exist in namespace {namespace!r}: call "
            f"destroy_engines(name_prefix={name_prefix!r}, namespace={namespace!r}) or pick "
            "another name_prefix"
        )
    backend_class(backend)  # fails here, before placement, if the backend module cannot import
    return spec.model_copy(
        update={
            "backend": backend,
            "engine_kwargs": kwargs,
            "namespace": namespace,
            "name_prefix": name_prefix,
        }
    )


def start_engine_set(spec: EngineSetSpec) -> EngineSet:
    """Start the engines (and spares) `spec` describes as named Ray actors.

    Returns at once with the handles (a list); engines load their model in the
    background: `ray.get(engine.ready.remote(), timeout=...)` waits for one.
    With `spec.sleep` it waits for them to be asleep (as OpenRLHF's
    `vllm_enable_sleep`: the trainer has the GPU until the first wake_up)."""
    ensure_ray()
    spec = on_this_cluster(spec)
    if spec.backend == "hf" and spec.tensor_parallel_size > 1:
        logger.warning(
            "backend 'hf' runs each engine in one process: tensor_parallel_size=%d reserves "
            "the bundles but computes on the first",
            spec.tensor_parallel_size,
        )
    placement = spec.placement.place(
        num_engines=spec.num_engines + spec.spare_engines,
        tensor_parallel_size=spec.tensor_parallel_size,
        name_prefix=spec.name_prefix,
        timeout_s=env.ready_timeout_s(),
    )
    engines = start_on(spec, placement)
    logger.info(
        "started %d %s engines: %s (namespace %r)%s",
        spec.num_engines,
        spec.backend,
        engines.names,
        spec.namespace,
        f", and spares {[spare.config.name for spare in engines.spares]}" if engines.spares else "",
    )
    if engines.prepared:
        logger.info("prepared actors: %s", [prepared.name for prepared in engines.prepared])
    if spec.sleep:
        try:
            raise_first_error(call_engines(engines, "sleep", timeout_s=env.ready_timeout_s()))
        except BaseException:
            destroy_engines(engines)
            raise
    return engines


def start_on(spec: EngineSetSpec, placement: EnginePlacement) -> EngineSet:
    """Start the engines and spares on their bundles, and the prepared
    actors; on any failure kill what started and give back the bundles."""
    handles, configs = [], []
    # On a shared GPU each engine's start waits for the one before (`wait_turn`).
    turn: list[Any] | None = None
    engines: EngineSet | None = None
    try:
        for i in range(spec.num_engines):
            config = EngineConfig(
                **spec.settings(),
                name=naming.engine_name(spec.name_prefix, i),
                seed=spec.seed + i,
                bundle_indices=placement.bundles[i],
                rpc_timeout_s=env.rpc_timeout_s(),
            )
            handles.append(start_engine(spec.backend, config, placement, spec.namespace, turn))
            configs.append(config)
            if placement.one_at_a_time:
                turn = [handles[-1].ready.remote()]
        engines = EngineSet(
            handles,
            configs=configs,
            name_prefix=spec.name_prefix,
            namespace=spec.namespace,
            backend=spec.backend,
            placement=placement,
        )
        for k in range(spec.spare_engines):
            spare = start_spare(engines, placement.bundles[spec.num_engines + k], turn)
            if placement.one_at_a_time:
                turn = [spare.asleep]
        if spec.prepared_actors:
            up = engines.up()
        for k in range(spec.prepared_actors):
            start_prepared(engines, placement.bundles[k % spec.num_engines][0], after=up)
    except BaseException:
        if engines is not None:
            handles += [spare.handle for spare in engines.spares]
            handles += [prepared.handle for prepared in engines.prepared]
        for handle in handles:
            ray.kill(handle, no_restart=True)
        if placement.owns_group:
            remove_placement_group(placement.placement_group)
        raise
    return engines


#: How long a failed engine's actor has to take a restart before it counts
#: as gone too (it then gets a new actor).
RESTART_ANSWER_S = 5.0


def restart_engine(engines: EngineSet, index: int, timeout_s: float = RESTART_ANSWER_S) -> bool:
    """Start engine `index` again inside its own actor (`RolloutEngine.restart`)
    after its engine died: no Ray worker start and no imports, so it costs
    the engine's own start only. False when that cannot be done and the
    caller must replace the actor: the actor is gone or does not answer, or
    the engine has TP>1 (vLLM's Ray workers of a dead engine core hold their
    GPUs until Ray notices their owner is gone). `ready()` waits for it."""
    config = engines.configs[index]
    if engines.backend == "vllm" and config.tensor_parallel_size > 1:
        return False
    try:
        get(engines[index].restart.remote(), timeout_s, config.name)
    except EngineFailure as exc:
        logger.info("engine %s cannot restart in its actor: %s", config.name, exc)
        return False
    logger.info("restarting engine %s in its actor", config.name)
    return True


def replace_engine(engines: EngineSet, index: int, timeout_s: float = 30.0) -> Any:
    """Kill engine `index` (dead or alive) and start a new one with the same
    name, config and bundles; `engines[index]` becomes the new handle."""
    kill(engines[index])
    # The name is only free once the old actor is gone.
    deadline = time.monotonic() + timeout_s
    name = engines.configs[index].name
    while name in existing_engine_names(engines.name_prefix, engines.namespace):
        if time.monotonic() > deadline:
            raise EngineTimeoutError(f"{name} did not go away within {timeout_s:g}s", engine=name)
        time.sleep(0.05)
    handle = start_engine(
        engines.backend, engines.configs[index], engines.placement, engines.namespace
    )
    engines[index] = handle
    logger.info("replaced engine %s (bundles %s)", name, engines.configs[index].bundle_indices)
    return handle


def destroy_engines(
    engines: list[Any] | None = None,
    *,
    name_prefix: str | None = None,
    namespace: str | None = None,
    timeout_s: float = 30.0,
) -> int:
    """Kill engines (given as handles, or found by name) and remove the placement
    groups created for them. Idempotent; returns how many live engines it stopped.

    Works from any process connected to the cluster (a failure hook, say): with
    `name_prefix` and `namespace` it needs no handle.
    """
    ensure_ray()
    name_prefix = name_prefix or getattr(engines, "name_prefix", None)
    namespace = namespace or getattr(engines, "namespace", None)
    namespace = namespace or ray.get_runtime_context().namespace
    handles = {handle._actor_id: handle for handle in engines or []}
    for spare in getattr(engines, "spares", []):
        handles[spare.handle._actor_id] = spare.handle
    for prepared in getattr(engines, "prepared", []):
        handles[prepared.handle._actor_id] = prepared.handle
    if name_prefix:
        for name in existing_engine_names(name_prefix, namespace):
            try:
                handle = ray.get_actor(name, namespace=namespace)
            except ValueError:  # gone between listing and lookup
                continue
            handles[handle._actor_id] = handle
    handles = list(handles.values())
    # A graceful shutdown first, so vLLM's engine-core process frees its GPU
    # memory; then kill regardless.
    results = call_engines(handles, "shutdown", timeout_s=min(timeout_s, 10.0)) if handles else []
    alive = sum(not isinstance(r.error, EngineDeadError) for r in results)
    for handle in handles:
        kill(handle)
    for spare in getattr(engines, "spares", []):
        # A spare stopped before its sleep call ran fails that call; fetched
        # here, or Ray logs it as an unhandled error once the ref is dropped.
        try:
            ray.get(spare.asleep, timeout=1.0)
        except Exception:  # noqa: BLE001 - any outcome will do
            pass
    placement = getattr(engines, "placement", None)
    if placement is not None and placement.owns_group:
        try:
            remove_placement_group(placement.placement_group)
        except Exception:  # noqa: BLE001 - already removed
            pass
    if name_prefix:
        remove_named_groups(name_prefix)
        deadline = time.monotonic() + timeout_s
        while existing_engine_names(name_prefix, namespace) and time.monotonic() < deadline:
            time.sleep(0.1)
    return alive
