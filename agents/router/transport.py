"""An httpx transport over aiohttp: the router's connections to the engines.

httpx's own pool (httpcore) walks every pooled connection on each request and
asks each idle one whether its socket is readable; with the router's tens of
sessions in flight that walk was the largest part of the router's CPU time a
turn. aiohttp's connector hands out a connection from a per-host queue. The
proxy keeps httpx's interface (its tests mount fake engines as httpx
transports), so the errors it acts on are raised as httpx's, and the client's
httpx timeouts apply per request.
"""

from __future__ import annotations

import aiohttp
import httpx

#: An idle pooled connection is closed by us before the engine's server
#: would close it (`engines.serving.KEEP_ALIVE_S`): never reused half-closed.
KEEP_ALIVE_S = 30.0


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Used from one event loop (its session is made there, on first use)."""

    def __init__(self, max_connections: int):
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=KEEP_ALIVE_S
                ),
                # The body as the engine sent it: httpx decodes it by its headers.
                auto_decompress=False,
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.get("connect"), sock_read=timeouts.get("read")
        )
        try:
            async with self._open().request(
                request.method,
                str(request.url),
                data=await request.aread(),
                headers=list(request.headers.multi_items()),
                allow_redirects=False,
                timeout=timeout,
            ) as answer:
                content = await answer.read()
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc), request=request) from exc
        except TimeoutError as exc:  # aiohttp's read timeout is one
            raise httpx.ReadTimeout(str(exc), request=request) from exc
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except aiohttp.ClientOSError as exc:
            raise httpx.ReadError(str(exc), request=request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.TransportError(str(exc), request=request) from exc
        return httpx.Response(
            answer.status, headers=list(answer.raw_headers), content=content, request=request
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
