"""One engine actor: its class for a backend, its Ray options (resources,
environment, bundles) and its start and end."""

from __future__ import annotations

from typing import Any

import ray

from engines import env
from engines.config import EngineConfig
from engines.lifecycle.placement import EnginePlacement


def backend_class(backend: str) -> type:
    # Imported here: the vLLM backend imports vllm, which CPU code must not need.
    if backend == "vllm":
        from engines.vllm import VLLMEngine

        return VLLMEngine
    from engines.hf import HFEngine

    return HFEngine


def start_engine(
    backend: str,
    config: EngineConfig,
    placement: EnginePlacement,
    namespace: str,
    after: list[Any] | None = None,
) -> Any:
    """Start an engine as a named actor on its bundles (`config.bundle_indices`);
    `after`: what its engine's start waits for (`startup.wait_turn`)."""
    tp = config.tensor_parallel_size
    return (
        ray.remote(backend_class(backend))
        .options(
            name=config.name,
            namespace=namespace,
            max_restarts=0,
            scheduling_strategy=placement.strategy(config.bundle_indices),
            **actor_resources(backend, placement, tp),
        )
        # Its environment as an argument, set first thing in the actor: with a
        # runtime_env's env_vars Ray starts a worker process for the actor
        # instead of taking one it started ahead (on the 2-core box 0.75 s
        # against 0.40 s to a trivial actor's __init__).
        .remote(config, after=after, environment=actor_env(backend, placement, config))
    )


def kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except ValueError:  # gone already
        pass


def actor_resources(backend: str, placement: EnginePlacement, tp: int) -> dict[str, float]:
    share = placement.share
    gpus = share if placement.uses_gpu else 0.0
    # vLLM's Ray executor starts one GPU worker per TP rank; the engine actor
    # itself then holds no GPU.
    if backend == "vllm" and tp > 1:
        gpus = 0.0
    return {"num_cpus": share, "num_gpus": gpus}


def node_cpus(placement: EnginePlacement, bundle: int) -> int:
    """The CPUs of the node that holds `bundle` of the engines' placement group."""
    from ray.util import placement_group_table

    node = placement_group_table(placement.placement_group)["bundles_to_node_id"].get(bundle)
    for info in ray.nodes():
        if info["NodeID"] == node and info["Alive"]:
            return max(1, int(info["Resources"].get("CPU", 1)))
    return 1


def actor_env(backend: str, placement: EnginePlacement, config: EngineConfig) -> dict[str, str]:
    fraction = None if placement.share == 1.0 else placement.share
    variables = env.actor_env_vars(
        backend,
        config.bundle_indices,
        fraction if config.tensor_parallel_size > 1 else None,
        node_cpus(placement, config.bundle_indices[0]) if backend == "vllm" else 1,
    )
    if backend == "vllm" and config.tensor_parallel_size > 1:
        # The engine core's Ray executor joins this cluster. vLLM sets this
        # itself only for a core it spawns; ours forks from a server that
        # inherited the actor's environment (engines/vllm/forkserver.py).
        variables[env.RAY_ADDRESS] = ray.get_runtime_context().gcs_address
    if config.full_determinism and backend == "vllm":
        # What OpenRLHF's full_determinism sets in its engine actors
        # (openrlhf/trainer/ray/vllm_engine.py, _configure_vllm_env).
        variables[env.VLLM_ENABLE_V1_MULTIPROCESSING] = "0"
    return variables
