"""The router's aiohttp transport behind an httpx client, against a local
aiohttp server: the exchange arrives whole both ways, and each way a
connection fails is raised as the httpx error the proxy acts on."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from aiohttp import web

from agents.router.transport import AiohttpTransport


async def serve(routes: web.RouteTableDef) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, shutdown_timeout=1.0)  # a hung handler is not waited on
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def client(timeout: float = 30.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(max_connections=8), timeout=timeout)


def test_a_request_and_its_answer_pass_whole():
    routes = web.RouteTableDef()
    seen = {}

    @routes.post("/v1/echo")
    async def echo(request: web.Request) -> web.Response:
        seen["auth"] = request.headers["Authorization"]
        body = await request.json()
        return web.json_response({"got": body}, status=201, headers={"X-Weight-Versions": "3,4"})

    async def main():
        runner, url = await serve(routes)
        try:
            async with client() as http:
                auth = {"Authorization": "Bearer k"}
                calls = [http.post(f"{url}/v1/echo", json={"n": n}, headers=auth) for n in range(9)]
                return await asyncio.gather(*calls)
        finally:
            await runner.cleanup()

    answers = asyncio.run(main())
    assert [a.json() for a in answers] == [{"got": {"n": n}} for n in range(9)]
    assert {a.status_code for a in answers} == {201}
    assert answers[0].headers["x-weight-versions"] == "3,4"
    assert seen["auth"] == "Bearer k"


def test_a_refused_connection_is_a_connect_error():
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def main():
        async with client() as http:
            await http.get(f"http://127.0.0.1:{port}/v1/models")

    with pytest.raises(httpx.ConnectError):
        asyncio.run(main())


def test_a_connection_dropped_mid_answer_is_a_lost_connection():
    routes = web.RouteTableDef()

    @routes.get("/v1/models")
    async def drop(request: web.Request) -> web.StreamResponse:
        request.transport.close()  # the engine died as it answered
        return web.Response()

    async def main():
        runner, url = await serve(routes)
        try:
            async with client() as http:
                await http.get(f"{url}/v1/models")
        finally:
            await runner.cleanup()

    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        asyncio.run(main())


def test_an_engine_that_never_answers_is_a_read_timeout():
    routes = web.RouteTableDef()

    @routes.get("/v1/models")
    async def hang(request: web.Request) -> web.Response:
        await asyncio.Event().wait()  # never set
        return web.Response()

    async def main():
        runner, url = await serve(routes)
        try:
            async with client(timeout=0.5) as http:
                await http.get(f"{url}/v1/models")
        finally:
            await runner.cleanup()

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(main())


def test_the_pool_closes_an_idle_connection_before_an_engines_server_would():
    """Else the router may send a turn on a connection the engine is closing
    ("Connection reset by peer": uvicorn's default 5 s was below aiohttp's 15 s)."""
    from engines.serving import OpenAIServer

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def scenario() -> tuple[float, float]:
        server = OpenAIServer("e0")
        url = await server.start(app, "key", lambda: 0)
        transport = AiohttpTransport(max_connections=8)
        try:
            async with httpx.AsyncClient(transport=transport) as http:
                answer = await http.get(url + "/models", headers={"Authorization": "Bearer key"})
                assert answer.status_code == 200
                pool_keeps = transport._open().connector._keepalive_timeout
        finally:
            await server.stop()
        return pool_keeps, server._server.config.timeout_keep_alive

    pool_keeps, server_keeps = asyncio.run(scenario())
    assert 0 < pool_keeps < server_keeps
