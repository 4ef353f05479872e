"""Admission of requests into an engine actor, closed while its weights change.

`close()` stops letting requests in and returns once every request already in
has finished; `open()` lets the waiting ones in. A request is stamped with the
weight version when it gets in, so it always runs on the weights it names.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class Admission:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inside = 0

    @asynccontextmanager
    async def request(self):
        """Wait until admission is open, then hold a place until the block ends."""
        while not self._open.is_set():
            await self._open.wait()
        self._inside += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inside -= 1
            if not self._inside:
                self._idle.set()

    async def close(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def open(self) -> None:
        self._open.set()
