"""Which engine serves a request: the router's placement, pure (no I/O).

"sticky": a session stays on the engine that served its first turn (its
prefix cache holds the conversation) unless that engine is dead or badly
overloaded; a new session, or a request without one, goes to the
least-loaded live engine. "round_robin": every request goes to the next live
engine in turn, sessions or not (the benchmark's baseline).

Least loaded, in this order: not near full (KV-cache use below `KV_FULL`),
fewest requests in flight, fewest sessions held, least KV-cache use. KV use
is what the engines last reported (`EngineLoad`, asked every fraction of a
second by the proxy), so it gates only near full and breaks the last tie:
a burst of new sessions within one report would otherwise all go to the
engine that looked emptiest. Requests in flight are the router's own count,
current at every pick; sessions held are the turns still to come.

Badly overloaded: KV use at `KV_OVERLOADED` or more with requests waiting
for room. A session moved off its engine pays one prefill of its history on
the new one; staying, its turn waits in the queue of a full engine (or
preempts running ones, which vLLM then recomputes), while another engine
has room. So a held session moves only then, and only to an engine that is
not overloaded itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from engines.load import EngineLoad

Routing = Literal["sticky", "round_robin"]
ROUTINGS: tuple[str, ...] = ("sticky", "round_robin")
#: KV-cache use at which an engine takes a new session only when all do.
KV_FULL = 0.8
#: KV-cache use at which an engine with requests waiting gives up sessions.
KV_OVERLOADED = 0.95


class RoutedEngineStats(BaseModel):
    """One engine as the router saw it: its requests, sessions and prompt tokens."""

    model_config = ConfigDict(frozen=True)

    name: str
    url: str
    alive: bool
    requests: int
    in_flight: int
    #: Sessions placed on this engine and not yet taken.
    sessions: int
    prompt_tokens: int
    #: Prompt tokens the engine reported served from its prefix cache.
    cached_prompt_tokens: int
    #: Requests whose connection to this engine was lost (then retried).
    failures: int
    #: The engine's own report (`EngineLoad`), as last asked: its sequences
    #: running and waiting, its KV-cache use (and the most the router saw).
    running: int
    waiting: int
    kv_cache_usage: float
    peak_kv_cache_usage: float
    #: Prompt tokens the engine looked up in its prefix cache since the
    #: router first asked it, and those it found (its scheduler's counters:
    #: every request it served, through the router or not).
    prefix_cache_queries: int
    prefix_cache_hits: int


class RouterStats(BaseModel):
    """The router's placement and every engine's figures (`Router.stats()`)."""

    model_config = ConfigDict(frozen=True)

    routing: Routing
    engines: list[RoutedEngineStats]
    open_sessions: int

    @property
    def cache_hit_ratio(self) -> float:
        """Cached / prompt tokens over every engine (0.0 before any request)."""
        prompt = sum(e.prompt_tokens for e in self.engines)
        return sum(e.cached_prompt_tokens for e in self.engines) / prompt if prompt else 0.0

    @property
    def engine_hit_ratio(self) -> float:
        """Prefix-cache hits / lookups as the engines count them (0.0 before any)."""
        queries = sum(e.prefix_cache_queries for e in self.engines)
        return sum(e.prefix_cache_hits for e in self.engines) / queries if queries else 0.0


@dataclass
class _Load:
    name: str
    url: str
    alive: bool = True
    requests: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    failures: int = 0
    #: The engine's last report, its first one (the counters' zero) and the
    #: most KV-cache use reported.
    report: EngineLoad = EngineLoad(0, 0, 0.0)
    first: EngineLoad | None = None
    peak_kv: float = 0.0

    @property
    def kv(self) -> float:
        return self.report.kv_cache_usage

    @property
    def overloaded(self) -> bool:
        return self.kv >= KV_OVERLOADED and self.report.waiting > 0

    def prefix_counts(self) -> tuple[int, int]:
        """Prefix-cache lookups and hits since the first report."""
        first = self.first or self.report
        return (
            self.report.prefix_cache_queries - first.prefix_cache_queries,
            self.report.prefix_cache_hits - first.prefix_cache_hits,
        )


class NoLiveEngineError(RuntimeError):
    """Every engine is down (or excluded for this request)."""


class SessionPlacement:
    """Which engine serves a session's request: engine loads, the sessions'
    engines, and the choice of an engine."""

    def __init__(self, engines: dict[str, str], routing: Routing):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.routing = routing
        self._loads = {name: _Load(name, url) for name, url in engines.items()}
        self._next = 0  # round robin's next position in the engines' order
        #: session id -> the engine holding it
        self.sessions: dict[str, str] = {}

    def url(self, engine: str) -> str:
        return self._loads[engine].url

    def pick(self, session: str | None) -> str:
        """The engine for the next request of `session` (None: no session);
        a session's engine is (re)assigned here."""
        live = self.live()
        if not live:
            raise NoLiveEngineError(f"no live engine left (down: {sorted(self._loads)})")
        held = self.sessions.get(session) if session is not None else None
        if self.routing == "round_robin":
            chosen = self._next_in_turn(live)
        elif held in live and not self._loads[held].overloaded:
            return held
        else:
            if held in live:  # overloaded: another engine only if one is not
                live = [n for n in live if not self._loads[n].overloaded] or [held]
            chosen = self._least_loaded(live)
        if session is not None:
            self.sessions[session] = chosen
        return chosen

    def _least_loaded(self, live: list[str]) -> str:
        held = self._held_counts()

        def load(name: str) -> tuple:
            at = self._loads[name]
            return (at.kv >= KV_FULL, at.in_flight, held[name], at.kv)

        return min(live, key=load)

    def _next_in_turn(self, live: list[str]) -> str:
        names = list(self._loads)
        while True:
            name = names[self._next % len(names)]
            self._next += 1
            if name in live:
                return name

    def add(self, engine: str, url: str) -> None:
        """A new engine, or one back (restarted, replaced under its name) at `url`."""
        load = self._loads.setdefault(engine, _Load(engine, url))
        load.url, load.alive = url, True

    def remove(self, engine: str) -> None:
        """`engine` is gone for good (replaced by another one): no request
        goes there; its sessions move on their next turn, as after a failure."""
        self._loads.pop(engine, None)
        self.sessions = {s: e for s, e in self.sessions.items() if e != engine}

    def begin(self, engine: str) -> None:
        load = self._loads[engine]
        load.requests += 1
        load.in_flight += 1

    def end(self, engine: str, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        load = self._loads.get(engine)
        if load is None:  # removed while the request ran
            return
        load.in_flight -= 1
        load.prompt_tokens += prompt_tokens
        load.cached_prompt_tokens += cached_tokens

    def connection_lost(self, engine: str, down: bool) -> None:
        """A request's connection to `engine` failed; `down`: the engine is
        dead, no new request goes there."""
        load = self._loads.get(engine)
        if load is None:  # removed while the request ran
            return
        load.failures += 1
        if down:
            load.alive = False

    def report(self, engine: str, load: EngineLoad) -> None:
        """`engine`'s own report of its load (asked by the proxy)."""
        at = self._loads.get(engine)
        if at is None:  # removed while it was asked
            return
        if at.first is None or load.prefix_cache_queries < at.report.prefix_cache_queries:
            at.first = load  # the first report, or the engine restarted: counters anew
        at.report, at.peak_kv = load, max(at.peak_kv, load.kv_cache_usage)

    def live(self) -> list[str]:
        return [name for name, load in self._loads.items() if load.alive]

    def forget(self, session: str) -> None:
        self.sessions.pop(session, None)

    def _held_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self._loads, 0)
        for engine in self.sessions.values():
            counts[engine] += 1
        return counts

    def stats(self) -> RouterStats:
        held = self._held_counts()
        return RouterStats(
            routing=self.routing,
            engines=[
                RoutedEngineStats(
                    name=load.name,
                    url=load.url,
                    alive=load.alive,
                    requests=load.requests,
                    in_flight=load.in_flight,
                    sessions=held[load.name],
                    prompt_tokens=load.prompt_tokens,
                    cached_prompt_tokens=load.cached_prompt_tokens,
                    failures=load.failures,
                    running=load.report.running,
                    waiting=load.report.waiting,
                    kv_cache_usage=load.kv,
                    peak_kv_cache_usage=load.peak_kv,
                    prefix_cache_queries=load.prefix_counts()[0],
                    prefix_cache_hits=load.prefix_counts()[1],
                )
                for load in self._loads.values()
            ],
            open_sessions=len(self.sessions),
        )
