"""How many shards each engine may hold in flight, set by its own load
(`RolloutEngine.load`) each time one of its shards finishes: one more while
no request waits in its queue and its KV cache is below the high-water mark,
half as many when requests wait, the cache is nearly full, or its shards
take much longer than the fastest engine's (additive increase,
multiplicative decrease, as TCP sets its congestion window). So each engine
runs near its best concurrency, and one that slows down gets less.

The windows live in the run's `EnginePool`, so an engine keeps its window
from one iteration to the next; a replaced engine starts over.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.load import EngineLoad

#: KV cache use past which an engine gets no more work: above it, vLLM
#: preempts running requests to make room (their work is recomputed).
KV_HIGH_WATER = 0.9
#: An engine whose shards cost this many times the fastest engine's is slow.
SLOW_FACTOR = 2.0
#: Weight of the newest shard in an engine's mean cost per shard.
COST_WEIGHT = 0.3


@dataclass
class Window:
    #: Shards the engine may hold in flight now.
    shards: int = 1
    #: Mean seconds per shard, each shard's seconds divided by the shards
    #: it shared the engine with (its own work, not the queue's).
    cost_s: float | None = None


class EngineWindows:
    """The windows of a pool's engines, by index."""

    def __init__(self, engines: int):
        self.windows = [Window() for _ in range(engines)]

    def allowed(self, engine: int, cap: int) -> int:
        """Shards `engine` may hold in flight, at most `cap`."""
        return min(cap, self.windows[engine].shards)

    def reset(self, engine: int) -> None:
        """A replaced engine: nothing known of it yet."""
        self.windows[engine] = Window()

    def finished(
        self, engine: int, seconds: float, sharing: int, load: EngineLoad | None, cap: int
    ) -> None:
        """A shard of `engine` finished in `seconds`, beside `sharing - 1`
        others of its engine; `load`: what the engine reported just after
        (None: it did not answer, the window stays)."""
        window = self.windows[engine]
        cost = seconds / max(1, sharing)
        window.cost_s = (
            cost
            if window.cost_s is None
            else (1 - COST_WEIGHT) * window.cost_s + COST_WEIGHT * cost
        )
        if load is None:
            return
        fastest = min(w.cost_s for w in self.windows if w.cost_s is not None)
        slow = window.cost_s > SLOW_FACTOR * fastest
        if slow or load.waiting > 0 or load.kv_cache_usage >= KV_HIGH_WATER:
            window.shards = max(1, window.shards // 2)
        else:
            window.shards = min(cap, window.shards + 1)
