"""The engine's OpenAI endpoint (engines/serving.py) on a real engine actor,
over real HTTP with the real `openai` client: its URL from the handle, the
run's token (401 otherwise, the engine still serving), weight versions on
every response, a weight sync during a running HTTP request (frozen, synced,
resumed: both versions named, per-token versions split where the sync
landed), a restart it survives, and the URL in the run's engine table."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import httpx
import openai
import pytest
import ray
from waiting import SETUP_TIMEOUT_S, wait_until

from engines import create_vllm_engines, destroy_engines, restart_engine, serving
from engines.serving import EndpointApi, ServingMiddleware, error_body
from tasks.engines import wait_ready
from tasks.run.pool import EnginePool

MAX_LEN = 1024


@pytest.fixture(scope="module")
def engines(ray_local_module, tiny_model):
    engines = create_vllm_engines(
        1, tiny_model, MAX_LEN, backend="hf", name_prefix="test-serving", openai_api=True
    )
    yield engines
    destroy_engines(engines)


@pytest.fixture(scope="module")
def url(engines) -> str:
    # The engine's start first, on the set-up deadline (a loaded box).
    ray.get(engines[0].ready.remote(), timeout=SETUP_TIMEOUT_S)
    return ray.get(engines[0].openai_url.remote(), timeout=60)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, timeout=120, max_retries=0)


def test_the_url_is_the_nodes_and_the_token_is_the_runs(engines, url, tiny_model):
    assert url == f"http://{ray.util.get_node_ip_address()}:{url.rsplit(':', 1)[1]}"
    assert url.endswith("/v1") and engines.api_key and len(engines.api_key) >= 32
    assert engines.api_key not in repr(engines.configs[0])  # a secret, not in reprs or logs
    models = client(url, engines.api_key).models.list()
    assert [m.id for m in models.data] == [tiny_model]


def test_a_wrong_or_missing_token_gets_401_and_the_engine_keeps_serving(engines, url):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": engines.api_key}):
        answer = httpx.get(f"{url}/models", headers=headers, timeout=30)
        assert answer.status_code == 401
        error = answer.json()["error"]
        assert error["code"] == 401 and "API key" in error["message"]
        assert engines.api_key not in answer.text
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").completions.create(model=None, prompt="hi", max_tokens=2)
    done = client(url, engines.api_key).completions.create(prompt="hi", max_tokens=2, model=None)
    assert len(done.choices) == 1


def test_every_response_names_its_weight_versions(engines, url):
    raw = client(url, engines.api_key).completions.with_raw_response.create(
        model=None, prompt="hello", max_tokens=3, extra_body={"return_token_ids": True}
    )
    body = raw.http_response.json()
    assert raw.headers["x-weight-versions"] == "0" and body["weight_versions"] == [0]
    assert body["choices"][0]["token_versions"] == [0] * len(body["choices"][0]["token_ids"])
    models = httpx.get(
        f"{url}/models", headers={"Authorization": f"Bearer {engines.api_key}"}, timeout=30
    )
    assert models.headers["x-weight-versions"] == "0" and "weight_versions" not in models.json()


def test_a_sync_during_a_running_http_request_freezes_and_resumes_it(engines, url, tmp_path):
    from transformers import AutoModelForCausalLM

    from engines.weight_sync.transports import checkpoint

    engine = engines[0]
    model = AutoModelForCausalLM.from_pretrained(engines.configs[0].pretrain)
    new = {
        name: tensor * 1.5 if "lm_head" in name or "embed" in name else tensor
        for name, tensor in model.state_dict().items()
    }
    path = checkpoint.save(new.items(), tmp_path / "v1", version=1)
    api = client(url, engines.api_key)
    ask = {
        "temperature": 0.0,
        "max_tokens": 900,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    old = api.completions.create(model=None, prompt=[[42, 71, 78]], **ask).choices[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            api.completions.with_raw_response.create, model=None, prompt=[[42, 71, 78]], **ask
        )
        wait_until(
            lambda: ray.get(engine.get_num_unfinished_requests.remote(), timeout=30),
            60,
            "the HTTP request to run",
        )
        ray.get(engine.pause_generation.remote(), timeout=60)
        assert not running.done()
        ray.get(engine.load_checkpoint.remote(str(path), version=1), timeout=120)
        assert not running.done(), "the sync's own resume let the request go"
        ray.get(engine.resume_generation.remote(), timeout=60)
        raw = running.result(timeout=300)
    body = raw.http_response.json()
    assert raw.headers["x-weight-versions"] == "0,1" and body["weight_versions"] == [0, 1]
    choice = body["choices"][0]
    tokens, versions = choice["token_ids"], choice["token_versions"]
    k = versions.index(1)
    assert 0 < k < len(tokens) and versions == [0] * k + [1] * (len(tokens) - k)
    assert tokens[:k] == old.token_ids[:k]  # sampled by the old weights
    # ... and from k on by the new ones: the greedy continuation of what came before.
    after = api.completions.create(
        model=None,
        prompt=[[42, 71, 78, *tokens[:k]]],
        temperature=0.0,
        max_tokens=8,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert after.choices[0].token_ids == tokens[k : k + 8]


def test_the_endpoint_serves_again_after_a_restart_and_in_the_engine_table(engines, url):
    pool = EnginePool(engines)
    wait_ready(pool, 120)
    assert pool.stats[0].openai_url == url and pool.stats[0].as_row()["openai_url"] == url
    assert restart_engine(engines, 0)
    ray.get(engines[0].ready.remote(), timeout=SETUP_TIMEOUT_S)
    again = ray.get(engines[0].openai_url.remote(), timeout=60)
    answer = client(again, engines.api_key).completions.create(
        model=None, prompt="hi", max_tokens=2
    )
    assert answer.choices and again.startswith(url.rsplit(":", 1)[0])


def test_callers_at_once_start_one_endpoint(monkeypatch):
    """`ready` and `openai_url` from several callers at once, the endpoint
    not yet up: one server starts, and every caller gets its URL."""
    started = []

    class Server:
        def __init__(self, engine):
            self.url, self.running = None, False

        async def start(self, app, api_key, version):
            await asyncio.sleep(0.05)  # others call meanwhile
            started.append(app)
            self.url, self.running = f"http://h:{len(started)}/v1", True

    class Engine(EndpointApi):
        config = SimpleNamespace(openai_api=True, name="e0", api_key="k")
        weight_version = 0

        def _openai_app(self):
            return "app"

    monkeypatch.setattr(serving, "OpenAIServer", Server)
    engine = Engine()

    async def callers():
        return await asyncio.gather(*(engine._serve_openai() for _ in range(3)))

    assert asyncio.run(callers()) == ["http://h:1/v1"] * 3 and started == ["app"]


def test_auth_compares_the_whole_bearer_token():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def run(headers):
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/models", "headers": headers}
        await ServingMiddleware(app, "secret", lambda: 0)(scope, None, send)
        return sent

    refused = asyncio.run(run([(b"authorization", b"Bearer secre")]))
    assert refused[0]["status"] == 401 and seen == []
    assert asyncio.run(run([(b"authorization", b"bearer secret")])) == [] and seen == ["/v1/models"]
    assert error_body("x", 404, "model")["error"] == {
        "message": "x",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_accepted_connections_send_without_waiting_for_acks():
    """TCP_NODELAY on every connection (else each response's second write
    waits out the client's delayed ACK: 47 ms a request, measured)."""
    import socket

    from engines.serving import _bind

    async def accept() -> list[int]:
        sock = _bind("127.0.0.1", 0)
        seen: list[int] = []

        def connected(reader, writer) -> None:
            raw = writer.get_extra_info("socket")
            seen.append(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(connected, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            for _ in range(500):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()
        return seen

    assert asyncio.run(accept()) == [1]
