"""The engines' own load reports for the router's placement: each live
engine's `EngineLoad` (KV-cache use, sequences running and waiting,
prefix-cache counters), asked at most every `REFRESH_S`.

Asked in the background of the requests that find the reports stale, so no
request waits on a slow engine's answer: placement works from the last
reports and the router's own count of requests in flight. Only the very
first ask is awaited, so the counters start before the first request runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from agents.router.placement import SessionPlacement
from engines.load import EngineLoad

logger = logging.getLogger(__name__)

#: How old the reports may grow before a request has them asked again: a
#: Ray call per engine, so a few a second cost nothing next to a turn.
REFRESH_S = 0.25
#: How long one engine has to report; a silent one keeps its last report
#: (a dead engine is found by its lost connection, not here).
ASK_TIMEOUT_S = 5.0

AskLoad = Callable[[str], Awaitable[EngineLoad]]


class LoadReports:
    """Asks every live engine of `placement` for its load (`ask(name)`) and
    hands the answers to `placement.report`."""

    def __init__(self, placement: SessionPlacement, ask: AskLoad):
        self._placement = placement
        self._ask = ask
        self._asked_at: float | None = None
        self._asking: asyncio.Task | None = None

    async def fresh(self) -> None:
        """Ask now (or join the ask in flight) and wait for the answers."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.create_task(self._ask_all())
        await asyncio.shield(self._asking)

    async def before_pick(self) -> None:
        """Before a placement: the first time, wait for the reports; later,
        ask again in the background when they are `REFRESH_S` old."""
        if self._asked_at is None:
            await self.fresh()
        elif time.monotonic() - self._asked_at >= REFRESH_S and (
            self._asking is None or self._asking.done()
        ):
            self._asking = asyncio.create_task(self._ask_all())

    async def _ask_all(self) -> None:
        names = self._placement.live()
        answers = await asyncio.gather(*(self._one(name) for name in names))
        for name, load in zip(names, answers, strict=True):
            if load is not None:
                self._placement.report(name, load)
        self._asked_at = time.monotonic()

    async def _one(self, name: str) -> EngineLoad | None:
        try:
            return await asyncio.wait_for(self._ask(name), ASK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - its last report stands
            logger.debug("engine %s did not report its load: %r", name, exc)
            return None
