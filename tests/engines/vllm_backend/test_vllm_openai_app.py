"""The vLLM backend's additions around vLLM's OpenAI app (engines/vllm/openai_app.py):
HTTP generations go through the engine's admission, and responses (served as
engines/serving.py serves them) name their weight versions. CI has no vLLM:
a stand-in AsyncLLM generates, and a small FastAPI route calls `generate` as
vLLM's serving classes do; the real app runs on the GPU
(tests/gpu/test_gpu_openai.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from engines.admission import Admission
from engines.errors import EngineSleepingError, EngineStaleError
from engines.serving import ServingMiddleware
from engines.vllm.openai_app import AdmittedClient, TokenVersions

TIMEOUT_S = 10


class StandInLLM:
    """vLLM's AsyncLLM as the app uses it: `generate` yields each completion's
    tokens as sampled (`step()` samples one more) and a final output; the
    output processor counts the tokens of each live request."""

    def __init__(self, n: int = 1):
        self.n = n
        self.tokens: dict[str, list[list[int]]] = {}
        self.stepped = asyncio.Condition()
        self.output_processor = SimpleNamespace(external_req_ids={}, request_states={})
        self.model_config = "the model config"

    async def step(self, request_id: str, count: int = 1) -> None:
        async with self.stepped:
            for completion in self.tokens[request_id]:
                completion.extend(range(count))
            self.stepped.notify_all()

    async def generate(self, prompt, params, request_id, **kwargs):
        self.tokens[request_id] = [[] for _ in range(self.n)]
        internal = [f"{i}_{request_id}" for i in range(self.n)]
        self.output_processor.external_req_ids[request_id] = internal
        for i, name in enumerate(internal):
            count = self.tokens[request_id][i].__len__
            detokenizer = SimpleNamespace(num_output_tokens=count)
            self.output_processor.request_states[name] = SimpleNamespace(
                request_index=i, detokenizer=detokenizer
            )
        async with self.stepped:
            await self.stepped.wait_for(lambda: len(self.tokens[request_id][0]) >= params)
        completions = enumerate(self.tokens[request_id])
        outputs = [SimpleNamespace(index=i, token_ids=list(t)) for i, t in completions]
        yield SimpleNamespace(finished=True, outputs=outputs)


class Engine:
    """What the client needs of an engine: its admission and version."""

    def __init__(self, llm: StandInLLM):
        self.version = 0
        self.asleep = False
        self.thawed = 0
        self.admission = Admission(
            freeze=self.noop, thaw=self.thaw, abort=self.noop, version=lambda: self.version
        )
        self.client = AdmittedClient(llm, self.admission, self.check)

    async def noop(self) -> None:
        pass

    async def thaw(self) -> None:
        self.client.mark_versions()
        self.thawed += 1

    def check(self) -> None:
        if self.asleep:
            raise EngineSleepingError("engine e0 is asleep")

    async def sync(self, version: int) -> None:
        """A sync as a trainer runs it: pause (keep), new weights, resume."""
        await self.admission.close("keep")
        self.version = version
        await self.admission.open()


def app_of(engine: Engine) -> FastAPI:
    """Routes that call `generate` as vLLM's serving classes do: a chat
    completion (one generate), a completions batch (one per prompt, run
    together) and a stream; `max_tokens` is the stand-in's token count."""
    app = FastAPI()
    client = engine.client

    async def final(request_id: str, max_tokens: int):
        async for output in client.generate("prompt", max_tokens, request_id):
            last = output
        return last

    @app.post("/chat")
    async def chat(body: dict):
        output = await final(body["id"], body["max_tokens"])
        choices = [{"index": c.index, "token_ids": c.token_ids} for c in output.outputs]
        return {"choices": choices}

    @app.post("/completions")
    async def completions(body: dict):
        ids = [f"{body['id']}_{i}" for i in range(body["prompts"])]
        finals = await asyncio.gather(*(final(i, body["max_tokens"]) for i in ids))
        choices = [c.token_ids for output in finals for c in output.outputs]
        return {"choices": [{"index": i, "token_ids": t} for i, t in enumerate(choices)]}

    @app.post("/stream")
    async def stream(body: dict):
        async def chunks():
            yield "data: start\n\n"
            output = await final(body["id"], body["max_tokens"])
            yield f"data: {len(output.outputs[0].token_ids)}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/models")
    async def models():
        return {"data": [{"id": "m"}]}

    ready = asyncio.Event()
    ready.set()
    return TokenVersions(app, ready=ready.wait)


def http(engine: Engine) -> httpx.AsyncClient:
    """The app as engines/serving.py serves it (auth, versions reported)."""
    served = ServingMiddleware(app_of(engine), "key", lambda: engine.version)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=served),
        base_url="http://e0",
        headers={"Authorization": "Bearer key"},
    )


async def until(predicate, what: str) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while not predicate():
            await asyncio.sleep(0.001)
    assert predicate(), what


def test_a_request_frozen_across_a_sync_names_both_versions_and_each_tokens_version():
    async def main():
        llm = StandInLLM(n=2)
        engine = Engine(llm)
        async with http(engine) as client:
            running = asyncio.ensure_future(
                client.post("/chat", json={"id": "r1", "max_tokens": 5}, timeout=TIMEOUT_S)
            )
            await until(lambda: "r1" in llm.tokens, "the request reached the engine")
            await llm.step("r1", 3)  # 3 tokens under version 0
            await engine.sync(1)  # frozen across it (the stand-in does not step)
            await llm.step("r1", 2)  # 2 more under version 1
            response = await running
        assert response.status_code == 200
        assert response.headers["x-weight-versions"] == "0,1"
        body = response.json()
        assert body["weight_versions"] == [0, 1]
        for choice in body["choices"]:
            assert choice["token_versions"] == [0, 0, 0, 1, 1]
        assert engine.thawed == 1

    asyncio.run(main())


def test_a_batch_numbers_its_choices_in_prompt_order():
    async def main():
        llm = StandInLLM()
        engine = Engine(llm)
        batch = {"id": "b", "prompts": 2, "max_tokens": 2}
        async with http(engine) as client:
            running = asyncio.ensure_future(
                client.post("/completions", json=batch, timeout=TIMEOUT_S)
            )
            await until(lambda: {"b_0", "b_1"} <= set(llm.tokens), "both prompts in")
            await llm.step("b_1", 2)  # the second prompt finishes under version 0
            await llm.step("b_0", 1)
            await engine.sync(4)
            await llm.step("b_0", 1)
            response = await running
        body = response.json()
        assert body["weight_versions"] == [0, 4]
        assert [c["token_versions"] for c in body["choices"]] == [[0, 4], [0, 0]]

    asyncio.run(main())


def test_a_paused_engine_holds_http_requests_at_its_door():
    async def main():
        llm = StandInLLM()
        engine = Engine(llm)
        await engine.admission.close("keep")
        async with http(engine) as client:
            running = asyncio.ensure_future(
                client.post("/chat", json={"id": "r2", "max_tokens": 1}, timeout=TIMEOUT_S)
            )
            for _ in range(50):
                await asyncio.sleep(0)
            assert "r2" not in llm.tokens and not running.done()
            engine.version = 2
            await engine.admission.open()
            await until(lambda: "r2" in llm.tokens, "the request let in")
            await llm.step("r2")
            response = await running
        assert response.json()["weight_versions"] == [2]
        assert response.headers["x-weight-versions"] == "2"

    asyncio.run(main())


def test_a_stream_and_a_route_without_generation_carry_the_header_and_an_unchanged_body():
    async def main():
        llm = StandInLLM()
        engine = Engine(llm)
        engine.version = 3
        async with http(engine) as client:
            models = await client.get("/models", timeout=TIMEOUT_S)
            # httpx's ASGI transport returns once the whole stream is sent.
            streaming = asyncio.ensure_future(
                client.post("/stream", json={"id": "s", "max_tokens": 1}, timeout=TIMEOUT_S)
            )
            await until(lambda: "s" in llm.tokens, "the stream's request in")
            engine.version = 4  # the header was sent before: it names version 3
            await llm.step("s")
            stream = await streaming
        assert stream.headers["x-weight-versions"] == "3"
        assert stream.text == "data: start\n\ndata: 1\n\n"
        assert models.json() == {"data": [{"id": "m"}]}
        assert models.headers["x-weight-versions"] == "3"
        assert int(models.headers["content-length"]) == len(models.content)

    asyncio.run(main())


def test_an_engine_that_refuses_work_refuses_http_requests_and_lets_no_ticket_linger():
    async def main():
        engine = Engine(StandInLLM())
        engine.asleep = True
        with pytest.raises(EngineSleepingError):
            async for _ in engine.client.generate("prompt", 1, "r3"):
                pass
        assert not engine.admission._tickets
        assert engine.client.model_config == "the model config"  # the rest is the AsyncLLM's

    asyncio.run(main())


def test_the_engine_counts_each_requests_tokens_before_vllm_steps_again():
    from engines.vllm import VLLMEngine
    from engines.vllm.core import CoreCalls

    order: list[str] = []

    async def resume_generation() -> None:
        order.append("vLLM resumes")

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM to start
    engine.engine = SimpleNamespace(errored=False, resume_generation=resume_generation)
    engine._core = CoreCalls(engine.engine, "e0")
    engine._http = SimpleNamespace(mark_versions=lambda: order.append("tokens counted"))
    asyncio.run(engine._thaw())
    assert order == ["tokens counted", "vLLM resumes"]


async def probed_sync(engine: Engine, version: int) -> None:
    """A sync with the probe: committed and resumed, its verdict pending
    (`engine.admission.settle` gives it)."""
    await engine.admission.close("keep")
    engine.version = version
    engine.admission.hold()
    await engine.admission.open()


def test_a_probe_holds_http_responses_until_it_passes():
    async def main():
        llm = StandInLLM()
        engine = Engine(llm)
        async with http(engine) as client:
            chat = asyncio.ensure_future(
                client.post("/chat", json={"id": "c", "max_tokens": 2}, timeout=TIMEOUT_S)
            )
            await until(lambda: "c" in llm.tokens, "the request in")
            await llm.step("c")
            await probed_sync(engine, 1)
            await llm.step("c")  # finished on the new weights, its verdict pending
            for _ in range(50):
                await asyncio.sleep(0)
            assert not chat.done()
            engine.admission.settle(None)
            response = await chat
        assert response.status_code == 200 and response.json()["weight_versions"] == [0, 1]

    asyncio.run(main())


def test_a_failed_probe_sends_nothing_computed_on_its_weights():
    async def main():
        llm = StandInLLM()
        engine = Engine(llm)
        async with http(engine) as client:
            requests = [
                asyncio.ensure_future(
                    client.post(f"/{route}", json={"id": route, "max_tokens": 1}, timeout=TIMEOUT_S)
                )
                for route in ("chat", "stream")
            ]
            await until(lambda: {"chat", "stream"} <= set(llm.tokens), "both requests in")
            await probed_sync(engine, 1)
            await llm.step("chat")
            await llm.step("stream")
            engine.admission.settle(EngineStaleError("engine e0: its probe failed", "e0"))
            return await asyncio.gather(*requests)

    chat, stream = asyncio.run(main())
    assert chat.status_code == 503 and "its probe failed" in chat.json()["error"]["message"]
    # The stream had begun before the generation (nothing computed then): it
    # ends with vLLM's error event instead of its token count.
    assert stream.text.startswith('data: start\n\ndata: {"error"')
    assert "its probe failed" in stream.text and "data: 1" not in stream.text
