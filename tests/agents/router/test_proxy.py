"""The router's proxy against fake engine apps (ASGI, in this test only),
driven by the real `openai` client: recording, placement, failover, errors.
The real engines' version of these: tests/agents/router/test_router_actor.py."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agents.router.proxy import SessionDefaults, SessionProxy, build_app
from engines.load import EngineLoad
from engines.serving import ServingMiddleware
from engines.trajectory import NOT_SAMPLED

KEY = "sk-test"


def fake_engine(name: str, rewrite_history: bool = False, version: int = 2) -> FastAPI:
    """One character per token; the "template" renders `role:content;` for each
    message (or, with `rewrite_history`, drops earlier assistant contents, as
    Qwen3's drops thinking); it "samples" `<name>-<turn>.` in response."""
    app = FastAPI()
    app.state.requests = []

    def render(messages) -> str:
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        parts = []
        for i, m in enumerate(messages):
            content = m["content"] or ""
            if rewrite_history and m["role"] == "assistant" and i < last:
                content = ""
            parts.append(f"{m['role']}:{content};")
        return "".join(parts) + "assistant:"

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        assert request.headers["authorization"] == f"Bearer {KEY}"
        body = await request.json()
        app.state.requests.append(body)
        prompt = render(body["messages"])
        text = f"{name}-{len(app.state.requests)}."
        ids = [ord(c) for c in text]
        payload = {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "prompt_token_ids": [ord(c) for c in prompt],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "token_ids": ids if body.get("return_token_ids") else None,
                    "logprobs": {"content": [{"logprob": -0.5} for _ in ids]}
                    if body.get("logprobs")
                    else None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
                "prompt_tokens_details": {"cached_tokens": 1},
            },
            "weight_versions": [version],
        }
        return JSONResponse(payload, headers={"X-Weight-Versions": str(version)})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return {"prompt": "".join(chr(t) for t in (await request.json())["tokens"])}

    return app


class Dying(httpx.AsyncBaseTransport):
    """An engine's connection, refused once `dead` is set (the engine died)."""

    def __init__(self, app: FastAPI):
        self.inner = httpx.ASGITransport(app)
        self.dead = False
        self.drops = 0  # requests whose connection drops, the engine alive

    async def handle_async_request(self, request):
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if self.drops:
            self.drops -= 1
            raise httpx.ReadError("connection reset", request=request)
        return await self.inner.handle_async_request(request)


class Setup:
    def __init__(self, routing="sticky", rewrite_history=False, defaults=None):
        self.apps = {n: fake_engine(n, rewrite_history) for n in ("e0", "e1")}
        self.links = {n: Dying(app) for n, app in self.apps.items()}
        client = httpx.AsyncClient(mounts={f"http://{n}": t for n, t in self.links.items()})
        urls = {n: f"http://{n}" for n in self.apps}
        #: What each engine reports of its own load (`EngineLoad`), and how often it was asked.
        self.loads = {n: EngineLoad(0, 0, 0.0) for n in self.apps}
        self.asked = dict.fromkeys(self.apps, 0)
        self.proxy = SessionProxy(
            urls, KEY, routing, client, self.alive, self.load, defaults or SessionDefaults()
        )
        # behind the engines' auth and version middleware, as the router actor serves it
        app = ServingMiddleware(build_app(self.proxy), KEY, lambda: self.proxy.latest_version)
        self.transport = httpx.ASGITransport(app)

    async def alive(self, engine: str) -> bool:
        return not self.links[engine].dead

    async def load(self, engine: str) -> EngineLoad:
        self.asked[engine] += 1
        return self.loads[engine]

    def client(self, session: str | None, key: str = KEY) -> openai.AsyncOpenAI:
        base = f"http://router/sessions/{session}/v1" if session else "http://router/v1"
        return openai.AsyncOpenAI(
            base_url=base,
            api_key=key,
            max_retries=0,
            http_client=httpx.AsyncClient(transport=self.transport),
        )


async def converse(client, turns: int, history=None):
    messages = history if history is not None else [{"role": "system", "content": "sys"}]
    for k in range(turns):
        messages.append({"role": "user", "content": f"q{k}"})
        reply = await client.chat.completions.create(model="fake", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return messages


def run(coro):
    return asyncio.run(coro)


def test_a_session_is_recorded_exactly_and_stays_on_its_engine():
    setup = Setup()

    async def go():
        await converse(setup.client("s1"), 3)
        stats = await setup.proxy.stats()
        return await setup.proxy.take("s1"), stats

    [sample], stats = run(go())
    requests = setup.apps["e0"].state.requests
    assert len(requests) == 3 and not setup.apps["e1"].state.requests
    # the router asked for token ids and sampled logprobs, n=1
    assert requests[0]["return_token_ids"] is True and requests[0]["top_logprobs"] == 0
    text = "".join(chr(t) for t in sample.prompt_token_ids + sample.response_token_ids)
    assert text == (
        "system:sys;user:q0;assistant:e0-1.;user:q1;assistant:e0-2.;user:q2;assistant:e0-3."
    )
    sampled = "".join(chr(t) for t in sample.sampled_token_ids)
    assert sampled == "e0-1.e0-2.e0-3."
    assert [t.role for t in sample.turns] == ["assistant", "environment"] * 2 + ["assistant"]
    env = sample.turns[1]
    assert "".join(chr(t) for t in sample.response_token_ids[env.start : env.stop]) == (
        ";user:q1;assistant:"
    )
    assert all(m == 0 for m in sample.loss_mask[env.start : env.stop])
    assert set(sample.token_versions[env.start : env.stop]) == {NOT_SAMPLED}
    assert {v for v, m in zip(sample.token_versions, sample.loss_mask, strict=True) if m} == {2}
    e0 = stats.engines[0]
    assert (e0.requests, e0.sessions, e0.cached_prompt_tokens) == (3, 1, 3)
    assert e0.prompt_tokens == 29 + 53 + 77  # the three rendered prompts
    # taken: forgotten
    assert run(setup.proxy.stats()).open_sessions == 0
    with pytest.raises(KeyError, match="already taken"):
        run(setup.proxy.take("s1"))


def test_a_sessions_requests_take_the_runs_sampling_unless_they_set_their_own():
    """The run's --max-tokens / --temperature reach an --agent session's
    requests that set none; a request's own values win; outside a session
    a request goes as it came."""
    setup = Setup(defaults=SessionDefaults(max_tokens=12, temperature=0.3))
    messages = [{"role": "user", "content": "q"}]

    async def go():
        session = setup.client("s").chat.completions
        await session.create(model="fake", messages=messages)
        await session.create(model="fake", messages=messages, max_tokens=5, temperature=0.0)
        await session.create(model="fake", messages=messages, max_completion_tokens=7)
        await setup.client(None).chat.completions.create(model="fake", messages=messages)

    run(go())
    requests = setup.apps["e0"].state.requests + setup.apps["e1"].state.requests
    sent = [(r.get("max_tokens"), r.get("temperature")) for r in requests]
    assert sent == [(12, 0.3), (5, 0.0), (None, 0.3), (None, None)]
    assert requests[2]["max_completion_tokens"] == 7


def test_new_sessions_go_to_the_least_loaded_engine():
    setup = Setup()

    async def go():
        await converse(setup.client("a"), 1)
        await converse(setup.client("b"), 1)
        await converse(setup.client("c"), 1)
        return await setup.proxy.stats()

    stats = run(go())
    assert {e.name: e.sessions for e in stats.engines} == {"e0": 2, "e1": 1}
    assert setup.proxy.placement.sessions == {"a": "e0", "b": "e1", "c": "e0"}


def test_placement_weighs_the_engines_reports_and_stats_carry_them():
    setup = Setup()
    # e0 near full before the first request: the first session goes to e1
    setup.loads["e0"] = EngineLoad(3, 0, 0.85, prefix_cache_queries=100, prefix_cache_hits=40)
    run(converse(setup.client("a"), 1))
    assert setup.proxy.placement.sessions == {"a": "e1"}
    assert setup.asked["e0"] >= 1
    # the counters count from the router's first report on
    setup.loads["e0"] = EngineLoad(1, 0, 0.5, prefix_cache_queries=300, prefix_cache_hits=190)
    stats = run(setup.proxy.stats())
    e0 = stats.engines[0]
    assert (e0.running, e0.kv_cache_usage, e0.peak_kv_cache_usage) == (1, 0.5, 0.85)
    assert (e0.prefix_cache_queries, e0.prefix_cache_hits) == (200, 150)
    assert stats.engine_hit_ratio == 0.75


def test_round_robin_alternates_every_request():
    setup = Setup(routing="round_robin")
    run(converse(setup.client("s"), 4))
    assert [len(setup.apps[n].state.requests) for n in ("e0", "e1")] == [2, 2]
    [sample] = run(setup.proxy.take("s"))
    assert [t.engine for t in sample.turns if t.role == "assistant"] == ["e0", "e1", "e0", "e1"]


def test_an_engine_that_dies_mid_session_hands_the_session_over():
    setup = Setup()

    async def go():
        messages = await converse(setup.client("s"), 2)
        setup.links["e0"].dead = True
        await converse(setup.client("s"), 1, messages)
        return await setup.proxy.take("s"), await setup.proxy.stats()

    [sample], stats = run(go())
    engines = [t.engine for t in sample.turns if t.role == "assistant"]
    assert engines == ["e0", "e0", "e1"]
    assert "".join(chr(t) for t in sample.sampled_token_ids) == "e0-1.e0-2.e1-1."
    by_name = {e.name: e for e in stats.engines}
    assert not by_name["e0"].alive and by_name["e0"].failures == 1
    assert by_name["e0"].in_flight == 0 and stats.open_sessions == 0


def test_a_dropped_connection_to_a_live_engine_is_retried_there():
    setup = Setup()
    setup.links["e0"].drops = 1
    run(converse(setup.client("s"), 1))
    assert len(setup.apps["e0"].state.requests) == 1 and not setup.apps["e1"].state.requests
    e0 = run(setup.proxy.stats()).engines[0]
    assert e0.alive and e0.failures == 1 and e0.sessions == 1


def test_no_engine_left_is_a_503_naming_the_engines_and_the_session():
    setup = Setup()
    for link in setup.links.values():
        link.dead = True
    with pytest.raises(openai.APIStatusError) as caught:
        run(converse(setup.client("lost"), 1))
    assert caught.value.status_code == 503
    message = caught.value.body["message"]
    assert "session 'lost'" in message and "e0 (ConnectError)" in message
    assert "e1 (ConnectError)" in message


def test_a_history_rewriting_template_splits_the_sample():
    setup = Setup(rewrite_history=True)
    run(converse(setup.client("s"), 3))
    first, second, third = run(setup.proxy.take("s"))
    assert first.split_reason is None
    # turn 2 renders "assistant:;" where the stream has "assistant:e0-1."
    assert second.split_reason.startswith("turn 2: its prompt leaves the token stream at")
    assert "the stream has 101 'e'" in second.split_reason
    assert "the prompt has 59 ';'" in second.split_reason
    assert third.split_reason.startswith("turn 3:")
    assert second.loss_mask == [1] * len(second.response_token_ids)


@pytest.mark.parametrize(("extra", "param"), [({"n": 2}, "n"), ({"stream": True}, "stream")])
def test_requests_a_session_cannot_record_are_a_400(extra, param):
    setup = Setup()

    async def go():
        client = setup.client("s")
        await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], **extra
        )

    with pytest.raises(openai.BadRequestError) as caught:
        run(go())
    assert caught.value.body["param"] == param
    assert not setup.apps["e0"].state.requests


def test_a_batch_of_prompts_in_a_session_is_a_400():
    setup = Setup()

    async def go():
        await setup.client("s").completions.create(model="fake", prompt=["a", "b"])

    with pytest.raises(openai.BadRequestError) as caught:
        run(go())
    assert caught.value.body["param"] == "prompt" and "batch of 2" in caught.value.body["message"]


def test_a_wrong_token_is_a_401_and_sessionless_requests_are_forwarded():
    setup = Setup()
    with pytest.raises(openai.AuthenticationError):
        run(converse(setup.client("s", key="sk-wrong"), 1))
    run(converse(setup.client(None), 1))
    assert len(setup.apps["e0"].state.requests) == 1
    assert "return_token_ids" not in setup.apps["e0"].state.requests[0]
    assert run(setup.proxy.stats()).open_sessions == 0
