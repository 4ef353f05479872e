"""Prepared actors: engine actors started with a set, their imports done
(vLLM's and its forkserver's, or torch's and transformers') and no engine,
holding no GPU. One takes the place of an engine whose actor was lost
(`adopt_prepared`), so the replacement pays the engine's own start only,
not the Ray worker's start and the imports (about 30 of a new actor's 41 s
on one H200: docs/benchmarks.md, "Replacing an engine").

Ray's accounting stays exact: the prepared actor asks for no resources (it
sits in a bundle of the set's placement group only to be on that bundle's
node), and as it adopts an engine it starts an anchor
(`engines.lifecycle.anchor`) that holds the lost engine's resources on the
lost engine's bundle and tells which GPU Ray gave them.

TP=1 only (`EngineSetSpec` refuses more): with TP>1 vLLM's Ray executor
places its workers from the engine actor's bundles, which a prepared actor
does not hold.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util import placement_group_table

from engines import naming
from engines.lifecycle.actors import actor_env, actor_resources, backend_class, kill
from engines.lifecycle.handles import EngineSet, Prepared

logger = logging.getLogger(__name__)


def start_prepared(engines: EngineSet, bundle: int, after: list[Any]) -> Prepared:
    """Start a prepared actor on `bundle`'s node, named past the engines so
    that sweeps by name find it; it joins `engines.prepared`. Its imports
    wait for `after` (the engines' `ready` refs: `wait_engines_up`)."""
    template = engines.template
    name = naming.engine_name(engines.name_prefix, engines.next_index)
    engines.next_index += 1
    config = template.model_copy(update={"name": name, "bundle_indices": [bundle]})
    handle = (
        ray.remote(backend_class(engines.backend))
        .options(
            name=name,
            namespace=engines.namespace,
            max_restarts=0,
            num_cpus=0,
            num_gpus=0,
            scheduling_strategy=engines.placement.strategy([bundle]),
        )
        .remote(
            config,
            after=after,
            prepare_only=True,
            # The engines' environment: the imports read some of it (OMP's threads).
            environment=actor_env(engines.backend, engines.placement, config),
        )
    )
    prepared = Prepared(handle, name, bundle, handle.startup_report.remote())
    engines.prepared.append(prepared)
    logger.info("started prepared actor %s on bundle %d's node", name, bundle)
    return prepared


def adopt_prepared(engines: EngineSet, index: int) -> Prepared | None:
    """Put a prepared actor on the node of engine `index` in its place: kill
    the old actor and begin its engine (same config, the prepared actor's
    name) in the prepared one, which becomes `engines[index]`; start another
    prepared actor (not waited for; its imports wait for this engine).
    `ready()` waits for the engine. Returns the prepared actor that took
    over, or None when none could (a prepared actor whose start failed is
    dropped)."""
    if not engines.prepared:
        return None
    config = engines.configs[index]
    nodes = placement_group_table(engines.placement.placement_group)["bundles_to_node_id"]
    node = nodes.get(config.bundle_indices[0])
    for prepared in list(engines.prepared):
        ready, _ = ray.wait([prepared.up], timeout=0)
        if ready and not succeeded(prepared.up):
            logger.warning("prepared actor %s did not start: dropped", prepared.name)
            engines.prepared.remove(prepared)
            kill(prepared.handle)
            continue
        if nodes.get(prepared.bundle) != node:
            continue
        engines.prepared.remove(prepared)
        kill(engines[index])
        adopted = config.model_copy(update={"name": prepared.name})
        placement = engines.placement
        anchor = {
            "scheduling_strategy": placement.strategy(config.bundle_indices),
            **actor_resources(engines.backend, placement, config.tensor_parallel_size),
        }
        # Not waited for here: `ready()` waits for the adoption and raises its error.
        prepared.handle.adopt.remote(adopted, actor_env(engines.backend, placement, config), anchor)
        engines[index] = prepared.handle
        engines.configs[index] = adopted
        engines.names[index] = prepared.name
        start_prepared(engines, prepared.bundle, after=[prepared.handle.ready.remote()])
        logger.info("prepared actor %s took the place of %s", prepared.name, config.name)
        return prepared
    return None


def succeeded(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - any failure to start
        return False
    return True
