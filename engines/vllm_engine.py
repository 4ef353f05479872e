"""`create_vllm_engines` and friends, API-compatible with OpenRLHF's
`openrlhf.trainer.ray.vllm_engine` module.

Everything is checked before anything is created: bad input raises
`EngineSpecError` naming the bad value and leaves no actor or placement group.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from engines import env, naming, spec
from engines.client import call_engines, get, raise_first_error
from engines.config import EngineConfig
from engines.errors import (
    BackendUnavailableError,
    EngineDeadError,
    EngineFailure,
    EngineSpecError,
    EngineTimeoutError,
)
from engines.placement import (
    EnginePlacement,
    place_engines,
    place_with_trainer,
    remove_named_groups,
    use_shared_group,
)

logger = logging.getLogger(__name__)

#: What vLLM takes for `gpu_memory_utilization=None` (EngineArgs, v0.26.0).
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class Spare:
    """A warm spare engine: started on bundles reserved for it and put to
    sleep once up; `asleep` is the ref of that sleep call (it completes when
    the spare is ready and asleep, or raises if it failed to start)."""

    handle: Any
    config: EngineConfig
    asleep: Any
    started_at: float


class EngineSet(list):
    """The engine handles (a plain list to callers), plus what it takes to find
    and clean them up: names, namespace and placement group; and the warm
    spares, outside the list."""

    def __init__(
        self,
        handles: list[Any],
        *,
        configs: list[EngineConfig],
        name_prefix: str,
        namespace: str,
        backend: str,
        placement: EnginePlacement,
    ):
        super().__init__(handles)
        self.configs = configs
        self.names = [config.name for config in configs]
        self.name_prefix = name_prefix
        self.namespace = namespace
        self.backend = backend
        self.placement = placement
        # What spares are made from: the first engine's config as created
        # (engine i samples with seed `template.seed + i`).
        self.template = configs[0] if configs else None
        self.spares: list[Spare] = []
        # The next actor name index: spares and their successors are named
        # `<prefix>-<i>` past the engines, so sweeps by name find them too.
        self.next_index = len(handles)


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


def backend_class(backend: str) -> type:
    # Imported here: the vLLM backend imports vllm, which CPU code must not need.
    if backend == "vllm":
        from engines.vllm import VLLMEngine

        return VLLMEngine
    from engines.hf import HFEngine

    return HFEngine


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


def create_vllm_engines(
    num_engines: int,
    pretrain: str,
    max_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = 1,
    seed: int = 42,
    enable_prefix_caching: bool = False,
    *,
    backend: str = "auto",
    name_prefix: str | None = None,
    namespace: str | None = None,
    shared_pg: PlacementGroup | None = None,
    max_model_len: int | None = None,
    full_determinism: bool = False,
    vllm_enable_sleep: bool = False,
    logprobs_mode: str | None = None,
    agent_func_path: str | None = None,
    remote_rm_url: Any = None,
    max_images_per_prompt: int = 0,
    spare_engines: int = 0,
    colocate_trainer: bool = False,
    **engine_kwargs: Any,
) -> EngineSet:
    """Start `num_engines` rollout engines as named Ray actors; engine i is named
    `<name_prefix>-<i>` in `namespace` and samples with seed `seed + i`.

    Returns at once with the handles (a list); engines load their model in the
    background: `ray.get(engine.ready.remote(), timeout=...)` waits for one.
    `engine_kwargs` are vLLM engine arguments (`enforce_eager`, `dtype`,
    `enable_sleep_mode`, ...). `shared_pg` places the engines on a caller's
    placement group with a fraction of each bundle (colocation with a trainer).
    Without `name_prefix` each call gets a prefix of its own.

    OpenRLHF's keyword names (v0.11.2) are accepted too: `max_model_len` is
    `max_len`; `vllm_enable_sleep=True` starts the engines in sleep mode and
    puts them to sleep once up (this call then waits for them);
    `full_determinism` sets OpenRLHF's `VLLM_ENABLE_V1_MULTIPROCESSING=0` in
    the engines; `logprobs_mode` sets vLLM's, with `max_logprobs=1`;
    `gpu_memory_utilization=None` is vLLM's default. `agent_func_path`,
    `remote_rm_url` and `max_images_per_prompt` are refused. Every check runs
    here, before anything is created (`EngineSpecError`).

    `spare_engines` (ours): that many more engines on bundles of the same
    placement group, put to sleep once up (`start_spare`); `swap_in_spare`
    puts one in a dead engine's place, awake, in seconds.

    `colocate_trainer` (ours): the engines and spares share one GPU with
    their trainer, as verl's hybrid engine does (on-policy RL on one GPU):
    one bundle, an equal share each; `engines.placement.trainer_options()`
    are the trainer's Ray options. Weights then go over CUDA IPC.
    """
    openrlhf = spec.OpenRLHFKeywords(
        max_model_len=max_model_len,
        full_determinism=full_determinism,
        vllm_enable_sleep=vllm_enable_sleep,
        logprobs_mode=logprobs_mode,
        agent_func_path=agent_func_path,
        remote_rm_url=remote_rm_url,
        max_images_per_prompt=max_images_per_prompt,
    )
    spec.check_unsupported(openrlhf)
    max_len = spec.resolve_max_len(max_len, max_model_len)
    spec.check_spec(
        num_engines, pretrain, max_len, gpu_memory_utilization, tensor_parallel_size, backend
    )
    if isinstance(spare_engines, bool) or not isinstance(spare_engines, int) or spare_engines < 0:
        raise EngineSpecError(f"spare_engines must be an integer >= 0, got {spare_engines!r}")
    ensure_ray()
    backend = resolve_backend(backend)
    if colocate_trainer:
        check_colocation(
            num_engines + spare_engines,
            tensor_parallel_size,
            gpu_memory_utilization,
            shared_pg,
            backend,
        )
    engine_kwargs = spec.resolve_engine_kwargs(engine_kwargs, openrlhf, backend)
    if spare_engines and backend == "vllm":
        # A spare sleeps, so it needs sleep mode; every engine of the set gets
        # it too: vLLM hashes it into the torch.compile cache key, and one key
        # lets the set, its spares and their successors share one warm cache.
        if engine_kwargs.get("enable_sleep_mode") is False:
            raise EngineSpecError(
                "spare_engines needs enable_sleep_mode (spares sleep until needed); "
                "leave it unset or True"
            )
        engine_kwargs["enable_sleep_mode"] = True
    namespace = namespace or ray.get_runtime_context().namespace
    name_prefix = name_prefix or naming.unique_prefix()
    taken = existing_engine_names(name_prefix, namespace)
    if taken:
        raise EngineSpecError(
            f"engines named {taken} already exist in namespace {namespace!r}: call "
            f"destroy_engines(name_prefix={name_prefix!r}, namespace={namespace!r}) or pick "
            "another name_prefix"
        )
    backend_class(backend)  # fails here, before placement, if the backend module cannot import
    if backend == "hf" and tensor_parallel_size > 1:
        logger.warning(
            "backend 'hf' runs each engine in one process: tensor_parallel_size=%d reserves "
            "the bundles but computes on the first",
            tensor_parallel_size,
        )
    if colocate_trainer:
        placement = place_with_trainer(
            num_engines=num_engines + spare_engines,
            uses_gpu=ray.cluster_resources().get("GPU", 0) > 0,
            name_prefix=name_prefix,
            timeout_s=env.ready_timeout_s(),
        )
    elif shared_pg is not None:
        placement = use_shared_group(
            shared_pg,
            num_engines=num_engines + spare_engines,
            tensor_parallel_size=tensor_parallel_size,
            timeout_s=env.ready_timeout_s(),
        )
    else:
        placement = place_engines(
            num_engines=num_engines + spare_engines,
            tensor_parallel_size=tensor_parallel_size,
            uses_gpu=ray.cluster_resources().get("GPU", 0) > 0,
            name_prefix=name_prefix,
            timeout_s=env.ready_timeout_s(),
        )

    handles, configs = [], []
    # On a shared GPU each engine's start waits for the one before (`wait_turn`).
    turn: list[Any] | None = None
    try:
        for i in range(num_engines):
            config = EngineConfig(
                name=naming.engine_name(name_prefix, i),
                pretrain=pretrain,
                max_len=max_len,
                seed=seed + i,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enable_prefix_caching=enable_prefix_caching,
                bundle_indices=placement.bundles[i],
                rpc_timeout_s=env.rpc_timeout_s(),
                full_determinism=full_determinism,
                engine_kwargs=engine_kwargs,
            )
            handles.append(start_engine(backend, config, placement, namespace, turn))
            configs.append(config)
            if placement.one_at_a_time:
                turn = [handles[-1].ready.remote()]
        engines = EngineSet(
            handles,
            configs=configs,
            name_prefix=name_prefix,
            namespace=namespace,
            backend=backend,
            placement=placement,
        )
        for k in range(spare_engines):
            spare = start_spare(engines, placement.bundles[num_engines + k], turn)
            if placement.one_at_a_time:
                turn = [spare.asleep]
    except BaseException:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        if placement.owns_group:
            remove_placement_group(placement.placement_group)
        raise
    logger.info(
        "started %d %s engines: %s (namespace %r)%s",
        num_engines,
        backend,
        engines.names,
        namespace,
        f", and spares {[spare.config.name for spare in engines.spares]}" if engines.spares else "",
    )
    if vllm_enable_sleep:
        # As OpenRLHF's create_vllm_engines: engines start asleep, so the
        # trainer has the GPU until the first wake_up.
        try:
            batch_vllm_engine_call(engines, "sleep", timeout_s=env.ready_timeout_s())
        except BaseException:
            destroy_engines(engines)
            raise
    return engines


def check_colocation(
    engines: int,
    tensor_parallel_size: int,
    gpu_memory_utilization: float | None,
    shared_pg: Any,
    backend: str,
) -> None:
    """`colocate_trainer`'s limits: one GPU holds every engine (spares
    included), each with `gpu_memory_utilization` of it, and the trainer."""
    if shared_pg is not None:
        raise EngineSpecError("colocate_trainer places the engines itself: drop shared_pg")
    if tensor_parallel_size != 1:
        raise EngineSpecError(
            f"colocate_trainer puts every engine on one GPU: tensor_parallel_size must be 1, "
            f"got {tensor_parallel_size}"
        )
    if backend != "vllm":
        return
    fraction = gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    if engines * fraction >= 1:
        raise EngineSpecError(
            f"colocate_trainer: {engines} engines (spares included) x gpu_memory_utilization="
            f"{fraction:g} fill the one GPU they share with the trainer; lower "
            "gpu_memory_utilization"
        )


def start_engine(
    backend: str,
    config: EngineConfig,
    placement: EnginePlacement,
    namespace: str,
    after: list[Any] | None = None,
) -> Any:
    """Start an engine as a named actor on its bundles (`config.bundle_indices`);
    `after`: what its engine's start waits for (`base.wait_turn`)."""
    tp = config.tensor_parallel_size
    return (
        ray.remote(backend_class(backend))
        .options(
            name=config.name,
            namespace=namespace,
            max_restarts=0,
            scheduling_strategy=placement.strategy(config.bundle_indices),
            runtime_env={"env_vars": actor_env(backend, placement, config)},
            **actor_resources(backend, placement, tp),
        )
        .remote(config, after=after)
    )


def start_spare(engines: EngineSet, bundles: list[int], after: list[Any] | None = None) -> Spare:
    """Start a spare on `bundles` (named past the engines) and ask it to sleep
    once up; it joins `engines.spares`. Sleep level 1 moves a vLLM spare's
    weights to host memory and drops its KV cache (the set is created in
    sleep mode when it has spares). `after`: as `start_engine`'s."""
    template = engines.template
    if template is None:
        raise EngineSpecError("a spare needs an engine set with at least one engine")
    index = engines.next_index
    config = template.model_copy(
        update={
            "name": naming.engine_name(engines.name_prefix, index),
            "seed": template.seed + index,
            "bundle_indices": list(bundles),
        }
    )
    handle = start_engine(engines.backend, config, engines.placement, engines.namespace, after)
    engines.next_index += 1
    # Runs once __init__ is done, i.e. once the spare is up.
    spare = Spare(handle, config, handle.sleep.remote(1), time.monotonic())
    engines.spares.append(spare)
    logger.info("started spare %s on bundles %s", config.name, bundles)
    return spare


def swap_in_spare(engines: EngineSet, index: int, timeout_s: float) -> Spare | None:
    """Put a spare in place of engine `index` (dead or alive): wait until the
    spare is up, wake it, make it `engines[index]`; kill the old engine and
    start a new spare on its bundles (in the background: not waited for).
    Returns the spare that took over, or None when there was none (or none
    started: a failed spare is dropped, and the next one tried).

    The caller syncs weights into the woken engine before it gets work."""
    while engines.spares:
        spare = engines.spares.pop(0)
        try:
            get(spare.asleep, timeout_s, spare.config.name)
            if engines.placement.one_at_a_time:
                # A GPU shared with the dead engine, whose memory may not be freed yet.
                get(spare.handle.wait_gpu_room.remote(timeout_s), timeout_s, spare.config.name)
            get(spare.handle.wake_up.remote(), timeout_s, spare.config.name)
        except Exception as exc:  # noqa: BLE001 - any failure: drop it, try the next
            logger.warning("spare %s cannot take over: %s", spare.config.name, exc)
            _kill(spare.handle)
            continue
        old, old_config = engines[index], engines.configs[index]
        _kill(old)
        engines[index] = spare.handle
        engines.configs[index] = spare.config
        engines.names[index] = spare.config.name
        start_spare(engines, old_config.bundle_indices)
        logger.info("spare %s took the place of %s", spare.config.name, old_config.name)
        return spare
    return None


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except ValueError:  # gone already
        pass


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
    old = engines[index]
    try:
        ray.kill(old, no_restart=True)
    except ValueError:
        pass
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


def actor_resources(backend: str, placement: EnginePlacement, tp: int) -> dict[str, float]:
    share = placement.share
    gpus = share if placement.uses_gpu else 0.0
    # vLLM's Ray executor starts one GPU worker per TP rank; the engine actor
    # itself then holds no GPU.
    if backend == "vllm" and tp > 1:
        gpus = 0.0
    return {"num_cpus": share, "num_gpus": gpus}


def actor_env(backend: str, placement: EnginePlacement, config: EngineConfig) -> dict[str, str]:
    fraction = None if placement.share == 1.0 else placement.share
    variables = env.actor_env_vars(
        backend,
        config.bundle_indices,
        fraction if config.tensor_parallel_size > 1 else None,
    )
    if backend == "vllm" and config.tensor_parallel_size > 1:
        # The engine core's Ray executor joins this cluster. vLLM sets this
        # itself only for a core it spawns; ours forks from a server that
        # inherited the actor's environment (engines/forkserver.py).
        variables[env.RAY_ADDRESS] = ray.get_runtime_context().gcs_address
    if config.full_determinism and backend == "vllm":
        # What OpenRLHF's full_determinism sets in its engine actors
        # (openrlhf/trainer/ray/vllm_engine.py, _configure_vllm_env).
        variables[env.VLLM_ENABLE_V1_MULTIPROCESSING] = "0"
    return variables


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
        try:
            ray.kill(handle, no_restart=True)
        except ValueError:
            pass
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


# Deadline of `batch_vllm_engine_call`: sleep and wake_up of a 70B model move
# its weights (140 GB in bf16) between GPU and host memory, and a pause in mode
# "wait" waits for the longest generation in flight.
BATCH_CALL_TIMEOUT_S = 600.0


def batch_vllm_engine_call(
    engines: list[Any],
    method_name: str,
    *args: Any,
    rank_0_only: bool = True,
    timeout_s: float = BATCH_CALL_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any] | None:
    """OpenRLHF's helper (openrlhf/trainer/ray/vllm_engine.py, v0.11.2): call
    `method_name` on every engine and return the results in order; with
    `rank_0_only`, a non-zero rank of an initialised torch.distributed group
    calls nothing and gets None. Raises the first engine's error; all calls
    share one deadline, `timeout_s`."""
    torch = sys.modules.get("torch")  # not imported here: flows must not need torch
    if rank_0_only and torch is not None and torch.distributed.is_initialized():
        if torch.distributed.get_rank() != 0:
            return None
    return raise_first_error(
        call_engines(engines, method_name, *args, timeout_s=timeout_s, **kwargs)
    )
