"""The run's engines and what happened to each of them.

An `EnginePool` lives in the flow process's memory only. It passes between
tasks as an argument of tasks declared with `cache_policy=NO_CACHE` and
`persist_result=False`: actor handles are never hashed, cached or persisted.
It is a plain object, not a list, so Prefect does not walk into it when it
resolves task inputs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import ray

from engines import (
    EngineDeadError,
    EngineSet,
    EngineTimeoutError,
    adopt_prepared,
    replace_engine,
    restart_engine,
    swap_in_spare,
)
from engines.client import get
from tasks.run.concurrency import EngineWindows

#: A result of a pool engine that `ray.wait` reported ready is fetched at
#: once; the deadline only guards against a pathological object store.
FETCH_TIMEOUT_S = 30.0


@dataclass
class EngineStats:
    name: str
    startup_s: float | None = None
    prompts: int = 0
    samples: int = 0
    tokens: int = 0
    generate_calls: int = 0
    #: Shards it finished, and the most it held in flight at once.
    shards: int = 0
    peak_shards: int = 0
    busy_s: float = 0.0  # wall time with at least one shard in flight
    failures: int = 0
    restarts: int = 0
    last_error: str | None = None
    #: The last replacement: "spare" (a warm spare woken), "restart" (the
    #: engine started again in its own actor, which outlived it), "prepared"
    #: (started in a prepared actor, its imports done) or "new" (a fresh
    #: engine actor), and the seconds from the failure's handling to serving
    #: again (up, and synced to the policy's weights in an on-policy run).
    replaced_by: str | None = None
    replacement_s: float | None = None
    #: The engine's OpenAI endpoint (run parameter openai_api), read once it is ready.
    openai_url: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.busy_s if self.busy_s > 0 else 0.0

    def as_row(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)}


class PoolClosedError(RuntimeError):
    """The run is ending: its engines are being torn down, none is replaced
    (not an `EngineFailure`, so a task's retry stops here)."""


class EnginePool:
    def __init__(self, engines: EngineSet, started_at: float | None = None):
        self.engines = engines
        self.stats = [EngineStats(name) for name in engines.names]
        self.started_at = [started_at or time.monotonic()] * len(engines)
        self.ready: set[int] = set()
        # Engines that died or hung, by index: replaced before the next try.
        self.failed: dict[int, BaseException] = {}
        # Replaced engines not yet serving, by index: when their replacement began.
        self.replacing_since: dict[int, float] = {}
        self.closed = False
        # Shards each engine may hold in flight, set by its load.
        self.windows = EngineWindows(len(engines))
        # Generation tasks run side by side (in_flight): one replaces at a time.
        self._replacing = threading.Lock()

    def close(self) -> None:
        """The run is ending: from now on no failed engine is replaced."""
        self.closed = True

    def __len__(self) -> int:
        return len(self.engines)

    def name(self, index: int) -> str:
        return self.engines.names[index]

    @property
    def restarts(self) -> int:
        """Engine restarts so far, over every engine."""
        return sum(stats.restarts for stats in self.stats)

    def live(self) -> list[int]:
        """The engines that may get work: not failed, and not a replacement
        still coming up or being synced (another task's dispatcher must not
        send it work before it serves the current weights)."""
        return [
            i
            for i in range(len(self.engines))
            if i not in self.failed and i not in self.replacing_since
        ]

    @contextmanager
    def replacement(
        self, logger: logging.Logger | logging.LoggerAdapter, timeout_s: float, wait_s: float
    ) -> Iterator[list[int]]:
        """Replace the failed engines (`replace_failed`) and yield their
        indices: the body brings them up and syncs them; on its exit they
        serve (`mark_serving`). One task at a time: another waits (at most
        `wait_s`), then finds them replaced. A body that raises leaves them
        failed, so the next try replaces them again."""
        if not self._replacing.acquire(timeout=wait_s):
            raise EngineTimeoutError(f"another task was still replacing engines after {wait_s:g}s")
        try:
            try:
                replaced = self.replace_failed(logger, timeout_s)
                yield replaced
            except BaseException as exc:
                # Under the lock every replacement in progress is this one's.
                for index in list(self.replacing_since):
                    del self.replacing_since[index]
                    self.mark_failed(index, exc)
                raise
            self.mark_serving(replaced)
        finally:
            self._replacing.release()

    def mark_failed(self, index: int, error: BaseException, restarts: int | None = None) -> None:
        """`restarts`: the engine's restart count when the failed work went to
        it; a failure of an engine since replaced (another task's retry did)
        leaves its replacement alone."""
        if index in self.failed or restarts not in (None, self.stats[index].restarts):
            return
        self.failed[index] = error
        self.ready.discard(index)
        self.stats[index].failures += 1
        self.stats[index].last_error = f"{type(error).__name__}: {error}"[:300]

    def replace_failed(
        self, logger: logging.Logger | logging.LoggerAdapter, timeout_s: float
    ) -> list[int]:
        """Put a warm spare (woken; a new spare starts on the failed engine's
        bundles) in place of each failed one, or else start it again in its
        actor (`restart_engine`: its engine died, the actor did not), or else
        in a prepared actor (`adopt_prepared`), or else a new engine actor
        (same name, config and bundles). Returns the
        replaced indices; `mark_serving` ends their replacement once they are
        up (and synced)."""
        if self.closed:
            raise PoolClosedError(
                f"the run is ending: engines {sorted(self.failed)} are not replaced"
            )
        replaced = sorted(self.failed)
        for index in replaced:
            stats = self.stats[index]
            logger.warning("replacing engine %s after %s", self.name(index), stats.last_error)
            self.replacing_since[index] = time.monotonic()
            # The fastest way first: a warm spare, then the engine started again
            # in its actor (only its engine died), then a prepared actor, then a new one.
            spare = swap_in_spare(self.engines, index, timeout_s)
            if spare is not None:
                logger.info("spare %s woke up in place of %s", spare.config.name, stats.name)
                self.ready.add(index)
                stats.replaced_by = "spare"
            else:
                dead = isinstance(self.failed[index], EngineDeadError)
                if dead and restart_engine(self.engines, index):
                    stats.replaced_by = "restart"
                elif adopt_prepared(self.engines, index) is not None:
                    stats.replaced_by = "prepared"
                else:
                    replace_engine(self.engines, index)
                    stats.replaced_by = "new"
                self.started_at[index] = time.monotonic()
            stats.name = self.name(index)
            stats.restarts += 1
            self.windows.reset(index)
            del self.failed[index]
        return replaced

    def mark_serving(self, indices: list[int]) -> None:
        """The replaced engines at `indices` serve again: record how long it took."""
        now = time.monotonic()
        for index in indices:
            since = self.replacing_since.pop(index, None)
            if since is not None:
                self.stats[index].replacement_s = round(now - since, 2)

    def wait_spares(self, logger: logging.Logger | logging.LoggerAdapter, timeout_s: float) -> None:
        """Wait until every spare is up and asleep; one that failed to start is
        dropped with a warning (the run goes on without it)."""
        deadline = time.monotonic() + timeout_s
        for spare in list(self.engines.spares):
            try:
                get(spare.asleep, max(0.0, deadline - time.monotonic()), spare.config.name)
            except Exception as exc:  # noqa: BLE001 - a spare is optional
                logger.warning("spare %s did not come up, dropped: %s", spare.config.name, exc)
                self.engines.spares.remove(spare)
                ray.kill(spare.handle, no_restart=True)

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
