"""Which engine serves a request: the router's placement, pure (no I/O).

"sticky": a session stays on the engine that served its first turn (its
prefix cache holds the conversation); a new session, or a request without
one, goes to the least-loaded live engine (fewest requests in flight, then
fewest sessions held, then the first). "round_robin": every request goes to
the next live engine in turn, sessions or not (the benchmark's baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

Routing = Literal["sticky", "round_robin"]
ROUTINGS: tuple[str, ...] = ("sticky", "round_robin")


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
        live = [name for name, load in self._loads.items() if load.alive]
        if not live:
            raise NoLiveEngineError(f"no live engine left (down: {sorted(self._loads)})")
        held = self.sessions.get(session) if session is not None else None
        if self.routing == "sticky" and held in live:
            return held
        if self.routing == "round_robin":
            chosen = self._next_in_turn(live)
        else:
            held_counts = self._held_counts()
            chosen = min(live, key=lambda n: (self._loads[n].in_flight, held_counts[n]))
        if session is not None:
            self.sessions[session] = chosen
        return chosen

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
                )
                for load in self._loads.values()
            ],
            open_sessions=len(self.sessions),
        )
