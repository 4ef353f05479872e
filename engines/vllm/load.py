"""The vLLM backend's load (`VLLMEngine.load`): vLLM's scheduler reports its
running and waiting requests and its KV cache use with each step's outputs
(`SchedulerStats`), to the stat loggers AsyncLLM was created with; one of
ours keeps the latest, and sums each step's prefix-cache lookups and hits.
Given one, AsyncLLM collects stats though `disable_log_stats` keeps vLLM's
own log lines off (`StatLoggerManager` in
https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

from typing import Any

from engines.load import EngineLoad


class SchedulerLoad:
    """The latest `SchedulerStats` of one AsyncLLM's engine core."""

    def __init__(self) -> None:
        self.latest: Any = None
        # Each step's stats hold that step's prefix-cache lookups only; vLLM's
        # Prometheus logger sums them into counters, and so do we.
        self.prefix_queries = 0
        self.prefix_hits = 0

    def record(self, stats: Any) -> None:
        self.latest = stats
        self.prefix_queries += stats.prefix_cache_stats.queries
        self.prefix_hits += stats.prefix_cache_stats.hits

    def stat_logger(self) -> type:
        """A stat-logger class for `AsyncLLM(stat_loggers=[...])`."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        holder = self

        class LatestSchedulerStats(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    holder.record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

        return LatestSchedulerStats

    def load(self, unfinished: int) -> EngineLoad:
        """`unfinished`: the sequences the front end still tracks. The core
        sends no stats while idle, so its last ones may be old: nothing
        unfinished is no load. Requests added since its last step are not in
        its stats yet: they count as waiting."""
        stats = self.latest
        counters = (self.prefix_queries, self.prefix_hits)
        if unfinished == 0:
            return EngineLoad(0, 0, 0.0, *counters)
        if stats is None:
            return EngineLoad(0, unfinished, 0.0, *counters)
        running = stats.num_running_reqs
        waiting = max(stats.num_waiting_reqs + stats.num_skipped_waiting_reqs, unfinished - running)
        return EngineLoad(running, waiting, float(stats.kv_cache_usage), *counters)
