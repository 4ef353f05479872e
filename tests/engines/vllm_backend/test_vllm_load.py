"""The vLLM backend's load from its scheduler's stats (fakes of vLLM's
`SchedulerStats`: the stat logger's record path needs no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

from engines.load import EngineLoad
from engines.vllm.load import SchedulerLoad


def step(running: int, waiting: int, usage: float, queries: int, hits: int):
    return SimpleNamespace(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=0,
        kv_cache_usage=usage,
        prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits),
    )


def test_prefix_cache_lookups_and_hits_are_summed_over_steps():
    load = SchedulerLoad()
    assert load.load(0) == EngineLoad(0, 0, 0.0)
    load.record(step(2, 1, 0.3, queries=512, hits=0))
    load.record(step(3, 0, 0.4, queries=600, hits=576))
    assert load.load(3) == EngineLoad(3, 0, 0.4, prefix_cache_queries=1112, prefix_cache_hits=576)
    # idle: no load, the counters stay
    assert load.load(0) == EngineLoad(0, 0, 0.0, prefix_cache_queries=1112, prefix_cache_hits=576)
