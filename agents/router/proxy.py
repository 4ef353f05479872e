"""The router's HTTP side: an ASGI app that forwards OpenAI requests to the
engines' endpoints and records each session's exact tokens.

`SessionProxy` holds the state (placement, sessions, the HTTP client to the
engines); `build_app` is its FastAPI front. The Ray actor that serves it is
`agents.router.actor`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agents.router.loads import AskLoad, LoadReports
from agents.router.placement import NoLiveEngineError, RouterStats, Routing, SessionPlacement
from agents.router.turns import TrajectoryBuilder, TurnParseError, describe_split, parse_turn
from engines.serving import VERSIONS_HEADER, error_body, record_versions
from engines.trajectory import TrajectorySample

#: The connection to an engine was refused, reset or dropped: the engine is
#: taken as down and the request is retried once on another one.
_CONNECTION_LOST = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)
_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
#: A request to the sessionless /v1 with this header is a turn of that session:
#: clients that pin a rollout's turns by header (verifiers sends its trace id
#: on every turn) get the session's recording without a per-session URL.
SESSION_HEADER = "X-Session-ID"


class ProxyError(Exception):
    """Answered in vLLM's (OpenAI's) error shape with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class SessionDefaults:
    """The run's sampling (`--max-tokens`, `--temperature`) for a session's
    requests that set none themselves: a request's own values win. None
    leaves it to the engine."""

    max_tokens: int | None = None
    temperature: float | None = None

    def under(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with the defaults it does not set (chat's
        `max_completion_tokens` sets its max tokens too)."""
        own = {name for name, value in body.items() if value is not None}
        body = dict(body)
        if self.temperature is not None and "temperature" not in own:
            body["temperature"] = self.temperature
        if self.max_tokens is not None and not own & {"max_tokens", "max_completion_tokens"}:
            body["max_tokens"] = self.max_tokens
        return body


@dataclass
class _Session:
    builder: TrajectoryBuilder = field(default_factory=TrajectoryBuilder)
    # One turn at a time: a session is one conversation, its turns in order.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionProxy:
    """Routes requests to engines (`engines`: name -> base URL, without /v1;
    `alive(name)`: whether that engine's actor still serves, asked when its
    connection is lost; `load(name)`: that engine's own `EngineLoad`, which
    placement weighs; `defaults`: the run's sampling for its sessions)."""

    def __init__(
        self,
        engines: dict[str, str],
        api_key: str,
        routing: Routing,
        client: httpx.AsyncClient,
        alive: Callable[[str], Awaitable[bool]],
        load: AskLoad,
        defaults: SessionDefaults = SessionDefaults(),  # noqa: B008 - frozen
    ):
        self.placement = SessionPlacement(engines, routing)
        self.reports = LoadReports(self.placement, load)
        self.defaults = defaults
        self._alive = alive
        self.api_key = api_key
        self._client = client
        self._sessions: dict[str, _Session] = {}
        #: The newest weight version an engine reported: the router's own
        #: answers (its errors) name it in their X-Weight-Versions header.
        self.latest_version = 0

    async def session_request(
        self, session_id: str, kind: Literal["chat", "completion"], body: Any
    ) -> httpx.Response:
        """One turn of a session: forwarded with token ids asked for, recorded."""
        _check_turn(body, kind)
        session = self._sessions.setdefault(session_id, _Session())
        async with session.lock:
            forwarded = _asking_ids(self.defaults.under(body), kind)
            engine, response, answer = await self._forward(
                session_id, "POST", _PATHS[kind], forwarded
            )
            if response.status_code != 200:
                return response
            try:
                if not isinstance(answer, dict):
                    raise TurnParseError(f"engine {engine} answered no JSON object")
                turn = parse_turn(answer, kind, engine, header_versions(response))
            except (TurnParseError, ValueError) as exc:
                raise ProxyError(502, f"session {session_id!r}: {exc}") from exc
            reason = None
            found = session.builder.mismatch(turn.prompt_token_ids)
            if found is not None:
                reason = describe_split(
                    session.builder.turn_count + 1,
                    found,
                    await self._token_text(engine, found.stream_token),
                    await self._token_text(engine, found.prompt_token),
                )
            session.builder.add_turn(turn, reason)
            return response

    async def plain_request(self, method: str, path: str, body: Any = None) -> httpx.Response:
        """A request outside any session, to the least-loaded (or next) engine."""
        if isinstance(body, dict) and body.get("stream"):
            raise ProxyError(400, "stream=true is not proxied; send stream=false", "stream")
        _, response, _ = await self._forward(None, method, path, body)
        return response

    async def take(self, session_id: str) -> list[TrajectorySample]:
        """The session's samples, in order; the session is forgotten."""
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"no session {session_id!r} (never seen, or already taken)")
        async with session.lock:  # a turn in flight is recorded first
            self._sessions.pop(session_id, None)
            self.placement.forget(session_id)
            return session.builder.samples()

    async def stats(self) -> RouterStats:
        """The placement's figures, with every engine's report asked anew."""
        await self.reports.fresh()
        return self.placement.stats()

    def forget_all(self) -> None:
        for session_id in list(self._sessions):
            self.placement.forget(session_id)
        self._sessions.clear()

    async def _forward(
        self, session_id: str | None, method: str, path: str, body: Any
    ) -> tuple[str, httpx.Response, Any]:
        """Send to the session's engine; on a lost connection, once more: to
        another live engine when this one is dead (the session moves there).
        Returns the engine, its response, and the response's JSON when it is
        a 200 (else None): parsed once, for the usage and the turn's record."""
        failed: list[str] = []
        break_reason = ""
        for _ in range(2):
            await self.reports.before_pick()
            try:
                engine = self.placement.pick(session_id)
            except NoLiveEngineError as exc:
                break_reason = str(exc)
                break
            self.placement.begin(engine)
            try:
                response = await self._client.request(
                    method,
                    self.placement.url(engine) + path,
                    json=body,
                    headers={"Authorization": f"Bearer {self.api_key}"},
                )
            except _CONNECTION_LOST as exc:
                self.placement.end(engine)
                # A live engine (a pooled connection it had closed): the same
                # engine again; a dead one: no more requests go there.
                self.placement.connection_lost(engine, down=not await self._alive(engine))
                failed.append(f"{engine} ({type(exc).__name__})")
                break_reason = f"engine {engine} lost the connection: {exc!r}"
                continue
            except httpx.TimeoutException as exc:
                self.placement.end(engine)
                raise ProxyError(
                    504, f"engine {engine} did not answer session {session_id!r} in time: {exc!r}"
                ) from exc
            answer = _json_of(response)
            self.placement.end(engine, *_prompt_usage(answer))
            self.latest_version = max([self.latest_version, *header_versions(response)])
            return engine, response, answer
        raise ProxyError(
            503,
            f"session {session_id!r}: no engine served the request; failed: "
            f"{', '.join(failed) or 'none'}; {break_reason}",
        )

    async def _token_text(self, engine: str, token: int | None) -> str | None:
        """The token's text, by the engine's /detokenize (None when it cannot say)."""
        if token is None:
            return None
        try:
            response = await self._client.post(
                self.placement.url(engine) + "/detokenize",
                json={"tokens": [token]},
                headers={"Authorization": f"Bearer {self.api_key}"},
            )
            return response.json()["prompt"] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None


def _check_turn(body: Any, kind: str) -> None:
    """What a session cannot record as one turn is a 400, before it is sent."""
    if not isinstance(body, dict):
        raise ProxyError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    n = body.get("n")
    if n not in (None, 1):
        raise ProxyError(
            400,
            f"n={n!r}: a session records one trajectory, so its requests take n=1 "
            f"(open one session per sample, or send n>1 to the sessionless /v1)",
            "n",
        )
    if body.get("stream"):
        raise ProxyError(
            400, "stream=true is not recorded in a session; send stream=false", "stream"
        )
    prompt = body.get("prompt")
    if kind == "completion" and isinstance(prompt, list) and prompt:
        if not all(isinstance(t, int) for t in prompt):  # a batch of prompts
            raise ProxyError(
                400,
                f"a session's completion takes one prompt (text or token ids), got a batch "
                f"of {len(prompt)}",
                "prompt",
            )


def _asking_ids(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The request as forwarded: token ids and sampled logprobs asked for (a
    caller's own logprobs settings are kept)."""
    body = {**body, "return_token_ids": True}
    if kind == "chat":
        if not body.get("logprobs"):
            body.update(logprobs=True, top_logprobs=0)
    elif body.get("logprobs") is None:
        body["logprobs"] = 0
    return body


def header_versions(response: httpx.Response) -> list[int]:
    raw = response.headers.get(VERSIONS_HEADER, "")
    return [int(v) for v in raw.split(",") if v.strip()]


def _json_of(response: httpx.Response) -> Any:
    """A 200's JSON body; None for an error or a body that is not JSON."""
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def _prompt_usage(answer: Any) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) from a JSON answer's usage."""
    usage = (answer.get("usage") if isinstance(answer, dict) else None) or {}
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0)


def _passthrough(request: Request, response: httpx.Response) -> Response:
    """The engine's answer as it is; its versions go to `ServingMiddleware`,
    which puts them in the router's own X-Weight-Versions header."""
    record_versions(request.scope, header_versions(response))
    return Response(
        response.content,
        status_code=response.status_code,
        media_type=response.headers.get("content-type", "application/json"),
    )


def build_app(proxy: SessionProxy) -> FastAPI:
    """The router's routes: a session's /sessions/{id}/v1/..., the sessionless
    /v1/... (a session's turn with the X-Session-ID header), /tokenize and
    /detokenize. Served behind `engines.serving`'s bearer-token auth and
    version header (`OpenAIServer`)."""
    app = FastAPI(title="rolloutflow router", openapi_url=None)

    @app.exception_handler(ProxyError)
    async def _error(_: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError as exc:
            raise ProxyError(400, f"the request body is not JSON: {exc}") from exc

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(session_id: str, request: Request) -> Response:
        response = await proxy.session_request(session_id, "chat", await body_of(request))
        return _passthrough(request, response)

    @app.post("/sessions/{session_id}/v1/completions")
    async def session_completion(session_id: str, request: Request) -> Response:
        response = await proxy.session_request(session_id, "completion", await body_of(request))
        return _passthrough(request, response)

    @app.get("/sessions/{session_id}/v1/models")
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return _passthrough(request, await proxy.plain_request("GET", "/v1/models"))

    def forwarding(path: str, kind: Literal["chat", "completion"] | None):
        async def plain(request: Request) -> Response:
            body = await body_of(request)
            session_id = request.headers.get(SESSION_HEADER)
            if kind is not None and session_id:
                response = await proxy.session_request(session_id, kind, body)
            else:
                response = await proxy.plain_request("POST", path, body)
            return _passthrough(request, response)

        return plain

    for kind, path in _PATHS.items():
        app.add_api_route(path, forwarding(path, kind), methods=["POST"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, forwarding(path, None), methods=["POST"])
    return app
