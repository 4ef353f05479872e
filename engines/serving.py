"""The engine's OpenAI endpoint: a backend's ASGI app (`RolloutEngine._openai_app`,
the routes without auth) served by uvicorn inside the engine actor's own
event loop (no extra process), on the node's address and a free port.

Around the backend's app: bearer-token auth (401 in OpenAI's error shape,
constant-time compare) and weight-version reporting: every response carries
`X-Weight-Versions: 3,4` (every version the request ran under, oldest first;
the version served now for routes that generate nothing), and a non-streaming
JSON body from a generating route gets a top-level `weight_versions` list.
A backend's route records its versions with `record_versions`. The engine
actor's methods that start and stop it are `EndpointApi`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from engines.config import EngineConfig
from engines.errors import RequestError

logger = logging.getLogger(__name__)

VERSIONS_HEADER = "X-Weight-Versions"
#: The ASGI scope key under which a request's weight versions are collected.
SCOPE_VERSIONS = "rolloutflow.weight_versions"
#: How long the server has to bind, and to close its connections when stopped.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
#: How long an idle client connection stays open. Longer than clients' pools
#: keep one (the router's 30 s, httpx's 5 s): uvicorn's default 5 s let the
#: router send a turn on a connection the engine was closing, and the turn
#: failed with "Connection reset by peer" (`make run-agent`, iteration 5).
KEEP_ALIVE_S = 75


def error_body(message: str, status: int, param: str | None = None, kind: str | None = None):
    """vLLM's ErrorResponse JSON (`{"error": {message, type, param, code}}`)."""
    return {
        "error": {
            "message": message,
            "type": kind or HTTPStatus(status).phrase.replace(" ", "") + "Error",
            "param": param,
            "code": status,
        }
    }


def record_versions(scope: dict[str, Any], versions: list[int]) -> None:
    """A route's request ran under `versions` (reported by `ServingMiddleware`;
    a no-op when the app runs without it)."""
    found = scope.get(SCOPE_VERSIONS)
    if found is not None:
        found.extend(v for v in versions if v not in found)


class ServingMiddleware:
    """Pure ASGI: auth first, then the app, then its weight versions on the response."""

    def __init__(self, app: Any, api_key: str, version: Callable[[], int]):
        self.app = app
        self._key = api_key.encode()
        self._version = version

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await send_json(
                send,
                HTTPStatus.UNAUTHORIZED,
                error_body(
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                    "with the run's openai_api_key",
                    HTTPStatus.UNAUTHORIZED,
                    kind="AuthenticationError",
                ),
            )
        versions: list[int] = []
        scope = {**scope, SCOPE_VERSIONS: versions}
        held: dict[str, Any] = {}
        body: list[bytes] = []

        async def reply(message) -> None:
            if message["type"] == "http.response.start":
                if _is_json(message):
                    held["start"] = message  # sent with the whole body, versions known
                    return
                return await send(_with_header(message, versions or [self._version()]))
            if "start" not in held:
                return await send(message)
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            start, content = held.pop("start"), b"".join(body)
            if versions and start["status"] == HTTPStatus.OK:
                content = _with_versions(content, versions)
            start = _with_header(start, versions or [self._version()])
            start["headers"] = [
                (k, str(len(content)).encode() if k.lower() == b"content-length" else v)
                for k, v in start["headers"]
            ]
            await send(start)
            await send({"type": "http.response.body", "body": content})

        await self.app(scope, receive, reply)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest: the time taken tells nothing about the key.
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._key)


def _is_json(start) -> bool:
    headers = dict(start.get("headers") or [])
    return headers.get(b"content-type", b"").startswith(b"application/json")


def _with_header(start, versions: list[int]):
    header = (VERSIONS_HEADER.lower().encode(), ",".join(map(str, versions)).encode())
    return {**start, "headers": [*start.get("headers", []), header]}


def _with_versions(content: bytes, versions: list[int]) -> bytes:
    data = json.loads(content)
    if not isinstance(data, dict):
        return content
    data["weight_versions"] = list(versions)
    return json.dumps(data).encode()


async def send_json(send, status: int, data: Any) -> None:
    content = json.dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": int(status),
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": content})


def _quiet_server():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn inside an actor: the actor's signals stay Ray's."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on `port`, or on a free one (port 0) when it is taken:
    bound here, so the port is known, and uvicorn never exits the actor's
    loop over a taken port (it calls sys.exit)."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so
    # (base_events._set_nodelay), and without it each response's second write
    # waited out the client's delayed ACK (47 ms a request, measured).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        if port == 0:
            raise
        return _bind(host, 0)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class OpenAIServer:
    """One engine's HTTP server; started again after a restart, on the same
    port when it is still free."""

    def __init__(self, engine: str):
        self.engine = engine
        self.url: str | None = None
        self._port = 0
        self._server: Any = None
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, app: Any, api_key: str, version: Callable[[], int]) -> str:
        """Serve `app` behind auth and version reporting; returns the base URL
        ("http://<node ip>:<port>/v1")."""
        import ray
        import uvicorn

        host = ray.util.get_node_ip_address()
        sock = _bind(host, self._port)
        config = uvicorn.Config(
            ServingMiddleware(app, api_key, version),
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=int(STOP_TIMEOUT_S),
        )
        server = _quiet_server()(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not server.started and not task.done():
            if asyncio.get_running_loop().time() > deadline:
                server.should_exit = True
                raise TimeoutError(f"engine {self.engine}: the OpenAI server did not start")
            await asyncio.sleep(0.01)
        if not server.started:
            await task  # raises why it ended
            raise RuntimeError(f"engine {self.engine}: the OpenAI server ended as it started")
        self._server, self._task = server, task
        self._port = sock.getsockname()[1]
        self.url = f"http://{host}:{self._port}/v1"
        logger.info("engine %s serves the OpenAI API at %s", self.engine, self.url)
        return self.url

    async def stop(self) -> None:
        if not self.running:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), STOP_TIMEOUT_S + 5)
        except TimeoutError:
            self._task.cancel()
        self.url = None


class EndpointApi:
    """The engine actor's OpenAI endpoint, written on a class its backends
    inherit (`RolloutEngine(..., EndpointApi, ...)`); a backend with one
    overrides `_openai_app`."""

    backend: str
    config: EngineConfig
    weight_version: int
    #: A `restart` in progress, or done (`RolloutEngine.restart`).
    _restart: asyncio.Future | None
    #: The OpenAI endpoint, kept across restarts: its port with it.
    _openai: OpenAIServer | None = None
    #: Held while the endpoint starts: callers at once (`ready`, `openai_url`)
    #: would each start a server, and all but the last would serve on, unknown.
    _openai_lock: asyncio.Lock | None = None

    async def openai_url(self) -> str | None:
        """The engine's OpenAI endpoint, "http://<node ip>:<port>/v1" (started
        if it was not yet); None without `config.openai_api`."""
        if self._restart is not None:
            await asyncio.shield(self._restart)
        return await self._serve_openai()

    async def _serve_openai(self) -> str | None:
        if not self.config.openai_api:
            return None
        if self._openai_lock is None:  # made on the actor's loop, which runs every call
            self._openai_lock = asyncio.Lock()
        async with self._openai_lock:
            if self._openai is None:
                self._openai = OpenAIServer(self.config.name)
            if not self._openai.running:
                await self._openai.start(
                    self._openai_app(), self.config.api_key, lambda: self.weight_version
                )
        return self._openai.url

    async def _stop_openai(self) -> None:
        """A backend's `shutdown` stops the endpoint first (a restart starts it again)."""
        if self._openai is not None:
            await self._openai.stop()

    def _openai_app(self) -> Any:
        """The backend's OpenAI routes as an ASGI app, without auth (`OpenAIServer`
        wraps and serves it)."""
        raise RequestError(f"backend {self.backend!r} has no OpenAI endpoint yet")
