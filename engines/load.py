"""What an engine reports of its own load (`RolloutEngine.load`): cheap to
ask, so the dispatcher asks after every shard (`tasks.run.concurrency`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """Sequences (a request with n samples counts n, as vLLM's scheduler
    counts them) being generated and waiting for a place in the batch, and
    the fraction of the engine's KV cache they hold (0 to 1)."""

    running: int
    waiting: int
    kv_cache_usage: float
