"""One URL per run in front of the engines' OpenAI endpoints: sticky
sessions, least-loaded placement, failover, and each session's exact tokens.

vLLM's router (`vllm-router` on PyPI) is Rust and picks a worker by load, prefix
or a hashed header only; we need per-session trajectory recording and failover
that moves a session, hence this small proxy (`agents.router.proxy`) in a Ray actor.

    router = start_router(engines, api_key)
    client = openai.AsyncOpenAI(base_url=router.session_url("s1"), api_key=api_key)
    ...                                         # the agent's turns
    samples = ray.get(router.actor.take_trajectory.remote("s1"))
    router.close()
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import ray

from agents.router.placement import ROUTINGS, RouterStats, Routing
from agents.router.proxy import SessionDefaults, SessionProxy, build_app
from agents.router.transport import AiohttpTransport
from engines.errors import EngineSpecError
from engines.load import EngineLoad
from engines.serving import OpenAIServer
from engines.trajectory import TrajectorySample

#: How long an engine whose connection was lost has to answer `health`.
ALIVE_TIMEOUT_S = 10.0


class RouterActor:
    """The Ray actor: the proxy, served by `engines.serving.OpenAIServer` in
    the actor's event loop (the engines' own server: bearer auth, the
    X-Weight-Versions header, the node's address, a free port)."""

    def __init__(self) -> None:
        self._proxy: SessionProxy | None = None
        self._server = OpenAIServer("router")
        self._client: httpx.AsyncClient | None = None
        self._handles: dict[str, Any] = {}

    async def _endpoint(self, handle: Any, timeout_s: float) -> tuple[str, str]:
        """(the engine's name, its endpoint's base URL without /v1)."""
        name = await asyncio.wait_for(handle.ready.remote(), timeout_s)
        url = await asyncio.wait_for(handle.openai_url.remote(), timeout_s)
        if url is None:
            raise EngineSpecError(
                f"engine {name} serves no OpenAI endpoint: create the engines with openai_api=True"
            )
        self._handles[name] = handle
        return name, url.removesuffix("/v1")

    async def start(
        self,
        engines: list[Any],
        api_key: str,
        routing: Routing,
        request_timeout_s: float,
        start_timeout_s: float,
        defaults: SessionDefaults,
    ) -> str:
        """Find every engine's endpoint, then serve; returns the router's URL."""
        urls = dict([await self._endpoint(handle, start_timeout_s) for handle in engines])
        self._client = httpx.AsyncClient(
            transport=AiohttpTransport(max_connections=1024),
            timeout=httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s)),
        )

        async def alive(name: str) -> bool:
            try:
                await asyncio.wait_for(self._handles[name].health.remote(), ALIVE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead, failed or hung: not serving
                return False
            return True

        async def load(name: str) -> EngineLoad:
            return await self._handles[name].load.remote()

        self._proxy = SessionProxy(urls, api_key, routing, self._client, alive, load, defaults)
        proxy = self._proxy
        url = await self._server.start(build_app(proxy), api_key, lambda: proxy.latest_version)
        return url.removesuffix("/v1")

    async def add_engine(self, handle: Any, timeout_s: float = 120.0) -> str:
        """Route to one more engine, or to an engine again after its restart or
        replacement under the same name (a dead engine gets nothing until then);
        returns its name."""
        name, url = await self._endpoint(handle, timeout_s)
        self._proxy.placement.add(name, url)
        return name

    async def set_engines(self, engines: list[Any], timeout_s: float = 120.0) -> list[str]:
        """Route to exactly `engines` from now on: the run replaced some (a
        spare woken under another name, or a restart or a new actor at another
        URL). Engines not among them are forgotten, their sessions move on
        their next turn. Returns the engines' names."""
        urls = dict([await self._endpoint(handle, timeout_s) for handle in engines])
        for name in set(self._handles) - set(urls):
            self._proxy.placement.remove(name)
            del self._handles[name]
        for name, url in urls.items():
            self._proxy.placement.add(name, url)
        return list(urls)

    async def take_trajectory(self, session_id: str) -> list[TrajectorySample]:
        """The session's samples, in order; the session is forgotten."""
        return await self._proxy.take(session_id)

    async def stats(self) -> RouterStats:
        return await self._proxy.stats()

    async def close(self) -> None:
        """Stop serving, forget every session, close the engines' client."""
        await self._server.stop()
        if self._proxy is not None:
            self._proxy.forget_all()
        if self._client is not None:
            await self._client.aclose()


@dataclass(frozen=True)
class Router:
    url: str
    actor: Any

    def session_url(self, session_id: str) -> str:
        """The base URL of an OpenAI client bound to `session_id`."""
        return f"{self.url}/sessions/{session_id}/v1"

    def stats(self, timeout_s: float = 30.0) -> RouterStats:
        return ray.get(self.actor.stats.remote(), timeout=timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the router (every session still open is forgotten) and end its actor."""
        try:
            ray.get(self.actor.close.remote(), timeout=timeout_s)
        finally:
            ray.kill(self.actor, no_restart=True)


def start_router(
    engines: list[Any],
    api_key: str,
    routing: Routing = "sticky",
    *,
    request_timeout_s: float = 600.0,
    start_timeout_s: float = 120.0,
    defaults: SessionDefaults = SessionDefaults(),  # noqa: B008 - frozen
    name: str | None = None,
    namespace: str | None = None,
) -> Router:
    """Start the router in front of `engines` (engine actor handles, each
    serving its OpenAI endpoint with the bearer token `api_key`); a
    session's requests that set no max_tokens or temperature get `defaults`'.
    `name`: the actor's name in `namespace` (a run's sweep finds it by name)."""
    if not engines:
        raise EngineSpecError("start_router needs at least one engine, got none")
    if routing not in ROUTINGS:
        raise EngineSpecError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not isinstance(api_key, str) or not api_key:
        raise EngineSpecError("start_router needs the engines' bearer token (api_key)")
    for field, value in (
        ("request_timeout_s", request_timeout_s),
        ("start_timeout_s", start_timeout_s),
    ):
        if not value > 0:
            raise EngineSpecError(f"{field} must be > 0, got {value!r}")
    options = dict(num_cpus=0, max_restarts=0, name=name, namespace=namespace)
    actor = ray.remote(RouterActor).options(**options).remote()
    try:
        url = ray.get(
            actor.start.remote(
                engines, api_key, routing, request_timeout_s, start_timeout_s, defaults
            ),
            timeout=start_timeout_s * (len(engines) + 1),
        )
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    return Router(url=url, actor=actor)
