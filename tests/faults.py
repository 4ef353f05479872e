"""Faults put into a live CPU engine actor."""

from __future__ import annotations

import ray


def end_generation_thread(engine, timeout_s: float = 60.0) -> None:
    """End the CPU engine's generation thread under its live actor, as vLLM's
    engine-core process dies under a live engine actor."""

    def end(actor) -> None:  # runs in the actor; nested, so pickled by value
        actor._loop.stop()
        actor._loop.thread.join(timeout=30)

    ray.get(engine.__ray_call__.remote(end), timeout=timeout_s)
