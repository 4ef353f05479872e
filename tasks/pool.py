"""The run's engines and what happened to each of them.

An `EnginePool` lives in the flow process's memory only. It passes between
tasks as an argument of tasks declared with `cache_policy=NO_CACHE` and
`persist_result=False`: actor handles are never hashed, cached or persisted.
It is a plain object, not a list, so Prefect does not walk into it when it
resolves task inputs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import ray

from engines import EngineSet
from engines.vllm_engine import replace_engine


@dataclass
class EngineStats:
    name: str
    startup_s: float | None = None
    prompts: int = 0
    samples: int = 0
    tokens: int = 0
    generate_calls: int = 0
    busy_s: float = 0.0  # wall time with at least one shard in flight
    failures: int = 0
    restarts: int = 0
    last_error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.busy_s if self.busy_s > 0 else 0.0

    def as_row(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)}


class EnginePool:
    def __init__(self, engines: EngineSet):
        self.engines = engines
        self.stats = [EngineStats(name) for name in engines.names]
        self.started_at = [time.monotonic()] * len(engines)
        self.ready: set[int] = set()
        # Engines that died or hung, by index: replaced before the next try.
        self.failed: dict[int, BaseException] = {}

    def __len__(self) -> int:
        return len(self.engines)

    def name(self, index: int) -> str:
        return self.engines.names[index]

    def live(self) -> list[int]:
        return [i for i in range(len(self.engines)) if i not in self.failed]

    def mark_failed(self, index: int, error: BaseException) -> None:
        if index in self.failed:
            return
        self.failed[index] = error
        self.ready.discard(index)
        self.stats[index].failures += 1
        self.stats[index].last_error = f"{type(error).__name__}: {error}"[:300]

    def replace_failed(self, logger: logging.Logger | logging.LoggerAdapter) -> list[int]:
        """Start a new engine, with the same name, config and placement bundle,
        in place of each failed one. Returns the replaced indices."""
        replaced = sorted(self.failed)
        for index in replaced:
            logger.warning(
                "replacing engine %s after %s", self.name(index), self.stats[index].last_error
            )
            replace_engine(self.engines, index)
            self.started_at[index] = time.monotonic()
            self.stats[index].restarts += 1
            del self.failed[index]
        return replaced

    def placement_problem(self) -> str | None:
        """Why engines may not come up, if placement is the reason: after a
        node is lost Ray re-places the group's bundles that were on it
        (RESCHEDULING) once the other nodes have room; the replacements wait
        for that, under the readiness deadline."""
        placement = self.engines.placement
        state = ray.util.placement_group_table(placement.placement_group).get("state")
        if state in (None, "CREATED"):
            return None
        return (
            f"their placement group is {state}: a node was lost and the remaining nodes lack "
            f"room for its bundles {placement.placement_group.bundle_specs}; add capacity, "
            "or rerun with fewer engines"
        )
