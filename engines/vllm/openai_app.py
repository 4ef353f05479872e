"""The vLLM backend's OpenAI routes: vLLM's own FastAPI app and serving
classes (`vllm/entrypoints/openai/api_server.py`: `build_app`,
`init_app_state`, the arguments of `make_arg_parser`), built on the engine
actor's AsyncLLM, so the protocol is vLLM's, not a copy of it.

What this module adds around vLLM's app:

- Admission: the app gets the AsyncLLM behind `AdmittedClient`, whose
  `generate` enters the engine's admission (`engines.admission`) as a Ray
  `generate` call does. So an HTTP request waits at the door while the engine
  is paused, is frozen, let finish or aborted by the pause modes, and holds a
  ticket that collects every weight version it ran under. After a sync with
  a probe, `TokenVersions` holds each send of the HTTP request until the
  probe's verdict on the weights it ran on; a failed one sends a 503 (or
  ends a stream under way with vLLM's error event), nothing computed on them.
- Weight versions: `TokenVersions`, an ASGI middleware, hands each HTTP
  request's versions to `engines.serving` (which writes `X-Weight-Versions`
  and the body's `weight_versions`) and, in a non-streaming JSON body, gives
  each choice that returned its `token_ids` its `token_versions`. A stream's
  header is sent before generation ends: it names the versions known then.

vLLM's modules are imported when the app is built, in the engine actor.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from engines.admission import Admission, Ticket, released
from engines.config import EngineConfig
from engines.errors import EngineSpecError, EngineStaleError, RequestError
from engines.serving import error_body, record_versions, send_json

#: A rollout engine generates; no pooling, transcription or render routes.
SUPPORTED_TASKS = ("generate",)


@dataclass(eq=False)  # one per engine request, by identity
class Generation:
    """One engine request of an HTTP request: a chat completion, or one
    prompt of a completions batch (vLLM calls `generate` once for each)."""

    request_id: str
    ticket: Ticket | None = None  # set once admitted
    # One entry per sync the request was frozen across: the tokens each
    # completion (by index) had sampled then, and the version sampling after.
    changes: list[tuple[dict[int, int], int]] = field(default_factory=list)
    # Tokens of each completion (by index), once finished.
    lengths: dict[int, int] = field(default_factory=dict)

    def token_versions(self, index: int) -> list[int] | None:
        if self.ticket is None or index not in self.lengths:
            return None
        length = self.lengths[index]
        versions = [self.ticket.versions[0]] * length
        for counts, version in self.changes:
            # A completion missing from the counts had finished before the sync.
            start = min(counts.get(index, length), length)
            versions[start:] = [version] * (length - start)
        return versions


@dataclass
class HttpRequest:
    """The generations of one HTTP request, in the order vLLM started them
    (a completions batch: prompt order, as its choices are numbered)."""

    generations: list[Generation] = field(default_factory=list)

    def versions(self) -> list[int]:
        seen = {v for g in self.generations if g.ticket for v in g.ticket.versions}
        return sorted(seen)

    async def released(self) -> None:
        """Return once what its generations computed may be sent (a probe's
        verdict on the weights they ran on); raise `EngineStaleError` if not."""
        for generation in self.generations:
            if generation.ticket is not None:
                await released(generation.ticket)

    def token_versions(self) -> list[list[int] | None]:
        """Per choice, in vLLM's numbering (generation order, then completion index)."""
        return [g.token_versions(index) for g in self.generations for index in sorted(g.lengths)]


_CURRENT: contextvars.ContextVar[HttpRequest | None] = contextvars.ContextVar(
    "rolloutflow_http_request", default=None
)


class AdmittedClient:
    """vLLM's engine client (the AsyncLLM) as vLLM's serving classes use it,
    with `generate` going through the engine's admission. Everything else is
    the AsyncLLM's own."""

    def __init__(self, llm: Any, admission: Admission, check: Callable[[], None]):
        """`check` raises when the engine refuses work (asleep, stale weights)."""
        self._llm = llm
        self._admission = admission
        self._check = check
        self._live: set[Generation] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        generation = Generation(request_id)
        request = _CURRENT.get()
        if request is not None:  # registered now, in the order vLLM numbers choices
            request.generations.append(generation)
        return self._admitted(generation, prompt, sampling_params, request_id, kwargs)

    async def _admitted(
        self, generation: Generation, prompt: Any, params: Any, request_id: str, kwargs: dict
    ) -> AsyncGenerator[Any, None]:
        # Not held here: `TokenVersions` holds each of the HTTP request's sends.
        async with self._admission.request(hold=False) as ticket:
            try:
                self._check()
            except EngineStaleError as exc:
                # vLLM's app answers a ValueError with a 400 naming it, any
                # other error with a bare 500.
                raise RequestError(str(exc)) from None
            generation.ticket = ticket
            self._live.add(generation)
            try:
                # aclosing: a client that goes away aborts vLLM's request.
                async with aclosing(self._llm.generate(prompt, params, request_id, **kwargs)) as it:
                    async for output in it:
                        if output.finished:
                            generation.lengths = {c.index: len(c.token_ids) for c in output.outputs}
                        yield output
            finally:
                self._live.discard(generation)

    def mark_versions(self) -> None:
        """Called as frozen requests are thawed after a sync (the ticket holds
        the new version, vLLM has not stepped since the freeze): record how
        many tokens each live request had sampled under the old weights."""
        processor = self._llm.output_processor
        for generation in self._live:
            versions = generation.ticket.versions
            last = generation.changes[-1][1] if generation.changes else versions[0]
            if versions[-1] == last:
                continue
            counts = {}
            for internal_id in processor.external_req_ids.get(generation.request_id, ()):
                state = processor.request_states.get(internal_id)
                if state is not None:
                    counts[state.request_index] = state.detokenizer.num_output_tokens()
            generation.changes.append((counts, versions[-1]))


class TokenVersions:
    """ASGI middleware: a record of each HTTP request's generations; their
    weight versions go to `engines.serving` (`record_versions`: the header and
    `weight_versions`), and each choice that returned its `token_ids` gets
    `token_versions`. `ready` is awaited before any request (vLLM's app state
    is built then)."""

    def __init__(self, app: Any, *, ready: Callable[[], Any]):
        self.app = app
        self.ready = ready

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.ready()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = HttpRequest()
        token = _CURRENT.set(request)
        start: dict | None = None
        refused = False

        async def reply(message: dict) -> None:
            nonlocal start, refused
            if message["type"] == "http.response.start":
                start = message  # held until the body shows whether it streams
                return
            if refused:
                return
            try:
                await request.released()
            except EngineStaleError as exc:
                refused = True
                await _refuse(send, start, exc)
                return
            if start is not None and message["type"] == "http.response.body":
                head, start = start, None
                if not message.get("more_body") and _is_json(head):
                    body = _with_token_versions(message.get("body", b""), request)
                    message = {**message, "body": body}
                    head = _with_length(head, len(body))
                record_versions(scope, request.versions())  # a stream: those known now
                await send(head)
            await send(message)

        try:
            await self.app(scope, receive, reply)
        finally:
            _CURRENT.reset(token)


async def _refuse(send: Any, start: dict | None, error: EngineStaleError) -> None:
    """Instead of what was computed on weights that failed their probe: a 503
    (the engine is stale; another engine may serve the request), or, for a
    stream already under way, vLLM's error event and the stream's end."""
    body = error_body(str(error), HTTPStatus.SERVICE_UNAVAILABLE)
    if start is not None:  # nothing sent yet
        await send_json(send, HTTPStatus.SERVICE_UNAVAILABLE, body)
        return
    events = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    await send({"type": "http.response.body", "body": events})


def _is_json(start: dict) -> bool:
    headers = dict(start.get("headers", []))
    return headers.get(b"content-type", b"").startswith(b"application/json")


def _with_length(start: dict, length: int) -> dict:
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    return {**start, "headers": [*headers, (b"content-length", str(length).encode())]}


def _with_token_versions(body: bytes, request: HttpRequest) -> bytes:
    """A generation's JSON body with `token_versions` on each choice that
    returned its `token_ids`."""
    if not request.generations or b'"token_ids"' not in body:
        return body  # nothing to add: no JSON round trip
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list):
        return body  # an error, or not a generation
    per_choice = request.token_versions()
    for choice in choices:
        index, token_ids = choice.get("index"), choice.get("token_ids")
        if token_ids is None or not isinstance(index, int) or index >= len(per_choice):
            continue
        versions = per_choice[index]
        if versions is not None and len(versions) == len(token_ids):
            choice["token_versions"] = versions
    return json.dumps(payload, separators=(",", ":")).encode()


def serve_args(pretrain: str, tool_call_parser: str | None) -> Any:
    """The namespace vLLM's app reads, from `vllm serve`'s own parser: the
    model's path is its id; prompt-token details (cached tokens in usage) on;
    tool calls parsed by `tool_call_parser` when given."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", pretrain, "--served-model-name", pretrain]
    argv += ["--enable-prompt-tokens-details", "--disable-log-stats"]
    if tool_call_parser is not None:
        known = ToolParserManager.list_registered()
        if tool_call_parser not in known:
            raise EngineSpecError(
                f"tool_call_parser={tool_call_parser!r} is not one of vLLM's: {sorted(known)}"
            )
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    # No auth in this app (engines/serving.py adds the run's token): an empty
    # key, since with none vLLM would take VLLM_API_KEY from the environment.
    args.api_key = [""]
    return args


def openai_app(
    config: EngineConfig, llm: Any, admission: Admission, check: Callable[[], None]
) -> tuple[Any, AdmittedClient]:
    """vLLM's FastAPI app on the AsyncLLM `llm` (no auth), and the client it
    generates through (the engine calls its `mark_versions` on a thaw).
    `admission` and `check`: the engine's door and its check of its own
    state (`RolloutEngine.check_request`)."""
    from vllm.entrypoints.openai.api_server import build_app, init_app_state

    args = serve_args(config.pretrain, config.tool_call_parser)
    # The engine's own door: Ray calls and HTTP requests share it.
    client = AdmittedClient(llm, admission, check)
    app = build_app(args, SUPPORTED_TASKS, llm.model_config)
    init: asyncio.Future | None = None

    async def ready() -> None:
        # vLLM's app state is built asynchronously, and this hook is not: it
        # is built once, in the server's event loop, before the first request.
        nonlocal init
        if init is None:
            init = asyncio.ensure_future(init_app_state(client, app.state, args, SUPPORTED_TASKS))
        await asyncio.shield(init)

    # Wrapped, not `app.add_middleware`: vLLM's build_app has built the
    # middleware stack already, and Starlette refuses additions after that.
    return TokenVersions(app, ready=ready), client
