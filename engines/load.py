"""What an engine reports of its own load (`RolloutEngine.load`): cheap to
ask, so the dispatcher asks after every shard (`tasks.run.concurrency`) and
the agents' router every fraction of a second (`agents.router.proxy`)."""

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
    #: Prompt tokens looked up in the prefix cache since the engine started,
    #: and those found there (vLLM's `vllm:prefix_cache_queries` and
    #: `_hits` counters; the CPU backend has no prefix cache: every prompt
    #: token is a query, none a hit). Counters: a reader takes differences.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
