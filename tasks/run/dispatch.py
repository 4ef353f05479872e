"""Pull-based dispatch of shards across engines, admitted by load.

Each engine pulls the next shard from the queue as soon as it has room, so a
slow or busy engine never holds the others back (an even split up front
would make every engine wait for the slowest). Its room is its window
(`tasks.run.concurrency`), at most `per_engine`: after each of its shards the
engine reports its load, and the window grows while nothing waits in its
queue and its KV cache has room, and shrinks when requests wait or its
shards slow down.

A shard is handed to `on_done` (which writes it) only when every one of its
requests has answered. When an engine dies or passes a shard's deadline, its
shards in flight are dropped whole, no new work is handed out, the other
engines finish what they hold, and the engine's failure is raised: the task
retry replaces the engine and redoes exactly the shards that were not written.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from engines import EngineFailure, EngineTimeoutError, RequestError
from engines.client import get
from tasks.run.pool import FETCH_TIMEOUT_S, EnginePool
from tasks.run.shards import Shard

#: Deadline for an engine's load report (an answer from its event loop, no
#: engine step): past it the engine keeps its window.
LOAD_TIMEOUT_S = 10.0


@dataclass(eq=False)
class InFlight:
    """One shard in flight on one engine: one request per prompt."""

    shard: Shard
    engine: int
    refs: list[Any]
    started: float
    deadline: float
    #: The engine's restart count at the start: which engine at that index.
    restarts: int
    #: Shards of this dispatch on the engine when it started, itself included.
    sharing: int
    results: dict[int, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.refs)


Submit = Callable[[int, Shard], list[Any]]
OnDone = Callable[[Shard, int, list[Any], float], None]


def run_shards(
    pool: EnginePool,
    shards: Sequence[Shard],
    submit: Submit,
    on_done: OnDone,
    *,
    per_engine: int,
    timeout_s: float,
) -> None:
    """Run `shards` on the pool's live engines. `submit(engine, shard)` sends
    the shard's requests and returns their refs (one per prompt, in order);
    `on_done(shard, engine, results, seconds)` gets the results in the same
    order. Raises the first engine failure once the survivors have drained."""
    Dispatcher(pool, submit, on_done, per_engine=per_engine, timeout_s=timeout_s).run(shards)


class Dispatcher:
    def __init__(
        self,
        pool: EnginePool,
        submit: Submit,
        on_done: OnDone,
        *,
        per_engine: int,
        timeout_s: float,
    ):
        self.pool = pool
        self.submit = submit
        self.on_done = on_done
        self.per_engine = per_engine
        self.timeout_s = timeout_s
        self.queue: deque[Shard] = deque()
        self.flights: list[InFlight] = []
        self.owner: dict[Any, tuple[InFlight, int]] = {}  # request ref -> (flight, position)
        self.busy_since: dict[int, float] = {}
        self.failure: EngineFailure | None = None

    def run(self, shards: Sequence[Shard]) -> None:
        self.queue.extend(shards)
        try:
            while True:
                if self.failure is None:
                    self.fill()
                if not self.flights:
                    break
                self.collect_one()
                self.expire()
        finally:
            # On any exit with work in flight (an error here, or the flow being
            # cancelled): stop the engines' work rather than let it run on.
            cancel(list(self.owner))
        if self.failure is not None:
            raise self.failure
        if self.queue:
            raise EngineFailure(f"{len(self.queue)} shards left and no live engine to run them")

    def load(self, engine: int) -> int:
        return sum(1 for flight in self.flights if flight.engine == engine)

    def fill(self) -> None:
        """Hand out shards round-robin, one per engine per pass, until every
        live engine holds its window or the queue is empty."""
        windows = self.pool.windows
        while self.queue:
            hungry = [
                e for e in self.pool.live() if self.load(e) < windows.allowed(e, self.per_engine)
            ]
            if not hungry:
                return
            for engine in hungry[: len(self.queue)]:
                self.start(engine, self.queue.popleft())

    def start(self, engine: int, shard: Shard) -> None:
        now = time.monotonic()
        refs = self.submit(engine, shard)
        stats = self.pool.stats[engine]
        sharing = self.load(engine) + 1
        flight = InFlight(shard, engine, refs, now, now + self.timeout_s, stats.restarts, sharing)
        self.flights.append(flight)
        self.owner.update({ref: (flight, pos) for pos, ref in enumerate(flight.refs)})
        self.busy_since.setdefault(engine, now)
        stats.generate_calls += len(flight.refs)
        stats.peak_shards = max(stats.peak_shards, sharing)

    def collect_one(self) -> None:
        """Wait for the next answer (or the nearest deadline) and file it."""
        wait_s = max(0.0, min(f.deadline for f in self.flights) - time.monotonic())
        ready, _ = ray.wait(list(self.owner), num_returns=1, timeout=wait_s)
        for ref in ready:
            if ref not in self.owner:  # its engine was dropped meanwhile
                continue
            flight, pos = self.owner.pop(ref)
            try:
                flight.results[pos] = get(ref, FETCH_TIMEOUT_S, self.pool.name(flight.engine))
            except EngineFailure as exc:
                self.drop_engine(flight, exc)
                continue
            except RequestError as exc:  # this request is bad: no retry can fix it
                entry = flight.shard.start + pos
                raise type(exc)(f"prompts file entry {entry}: {exc}") from exc
            if flight.complete:
                self.settle(flight)
                seconds = time.monotonic() - flight.started
                self.admit_by_load(flight, seconds)
                ordered = [flight.results[i] for i in range(len(flight.refs))]
                self.on_done(flight.shard, flight.engine, ordered, seconds)

    def admit_by_load(self, flight: InFlight, seconds: float) -> None:
        """Set the engine's window by the load it reports now its shard is done."""
        engine = flight.engine
        self.pool.stats[engine].shards += 1
        try:
            load = get(
                self.pool.engines[engine].load.remote(), LOAD_TIMEOUT_S, self.pool.name(engine)
            )
        except EngineFailure:
            load = None  # its next requests say what happened to it
        self.pool.windows.finished(engine, seconds, flight.sharing, load, self.per_engine)

    def expire(self) -> None:
        """An engine that did not finish a shard by its deadline counts as hung."""
        now = time.monotonic()
        for flight in [f for f in self.flights if f.deadline <= now]:
            if flight in self.flights:  # not dropped with an earlier one of its engine
                name = self.pool.name(flight.engine)
                self.drop_engine(
                    flight,
                    EngineTimeoutError(
                        f"{name} did not finish shard {flight.shard.index} within "
                        f"{self.timeout_s:g}s",
                        name,
                    ),
                )

    def settle(self, flight: InFlight) -> None:
        self.flights.remove(flight)
        for ref in flight.refs:
            self.owner.pop(ref, None)
        if self.load(flight.engine) == 0 and flight.engine in self.busy_since:
            busy = time.monotonic() - self.busy_since.pop(flight.engine)
            self.pool.stats[flight.engine].busy_s += busy

    def drop_engine(self, failed: InFlight, error: EngineFailure) -> None:
        """Give up on the engine of `failed`: its unfinished shards are lost
        whole (never written in part); no new work goes out; the failure is
        raised at the end. The pool marks the engine failed unless another
        task has replaced it meanwhile (the retry then finds nothing to replace)."""
        engine = failed.engine
        self.failure = self.failure or error
        self.pool.mark_failed(engine, error, failed.restarts)
        for flight in [f for f in self.flights if f.engine == engine]:
            cancel(flight.refs)
            self.settle(flight)


def cancel(refs: list[Any]) -> None:
    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception:  # noqa: BLE001 - best effort: the engine may be gone already
            pass
