"""Warm spares: engines started with a set on bundles reserved for them and
put to sleep once up, so one takes a dead engine's place, awake, in seconds
(`swap_in_spare`) instead of a cold start."""

from __future__ import annotations

import logging
import time
from typing import Any

from engines import naming
from engines.client import get
from engines.errors import EngineSpecError
from engines.lifecycle.actors import kill, start_engine
from engines.lifecycle.handles import EngineSet, Spare

logger = logging.getLogger(__name__)


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
            kill(spare.handle)
            continue
        old, old_config = engines[index], engines.configs[index]
        kill(old)
        engines[index] = spare.handle
        engines.configs[index] = spare.config
        engines.names[index] = spare.config.name
        start_spare(engines, old_config.bundle_indices)
        logger.info("spare %s took the place of %s", spare.config.name, old_config.name)
        return spare
    return None
