"""Faults put into a live CPU engine actor."""

from __future__ import annotations

import ray
from leak_guard import ray_actors
from waiting import wait_until


def end_generation_thread(engine, timeout_s: float = 60.0) -> None:
    """End the CPU engine's generation thread under its live actor, as vLLM's
    engine-core process dies under a live engine actor."""

    def end(actor) -> None:  # runs in the actor; nested, so pickled by value
        actor._loop.stop()
        actor._loop.thread.join(timeout=30)

    ray.get(engine.__ray_call__.remote(end), timeout=timeout_s)


def kill_and_wait(actor, timeout_s: float = 120.0) -> None:
    """`ray.kill`, then wait until the cluster has it dead: the kill is
    asynchronous, and a call sent meanwhile may still be answered."""
    ray.kill(actor, no_restart=True)
    actor_id = actor._actor_id.hex()
    wait_until(lambda: actor_id not in ray_actors(), timeout_s, f"actor {actor_id} dead")
