"""The state of one sync on an engine (`OpenSync`): its version, what it
touched, the calls running inside it, and the watchdog that aborts it when
the trainer goes silent between calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class OpenSync:
    """The state of one sync on an engine, and its watchdog."""

    version: int
    on_failure: str  # "restore" | "stale"
    idle_timeout_s: float
    implicit: bool = False  # opened by an OpenRLHF-style update_weight call
    touched: bool = False  # some weights were (maybe partly) loaded
    # The workers hold something of this sync that `end_weight_sync` must drop.
    worker_state: bool = False
    received: set[str] = field(default_factory=set)  # names, for implicit syncs
    active_calls: int = 0
    last_activity: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    watchdog: asyncio.Task | None = None

    @asynccontextmanager
    async def call(self):
        """Wrap every call that works inside the session: the watchdog waits."""
        self.active_calls += 1
        try:
            yield self
        finally:
            self.active_calls -= 1
            self.last_activity = time.monotonic()

    def idle_for(self) -> float:
        return 0.0 if self.active_calls else time.monotonic() - self.last_activity

    def start_watchdog(self, on_expiry: Callable[[OpenSync], Awaitable[Any]]) -> None:
        async def watch() -> None:
            while True:
                remaining = self.idle_timeout_s - self.idle_for()
                if remaining <= 0:
                    logger.error(
                        "weight sync to version %d had no call for %.0fs: aborting it",
                        self.version,
                        self.idle_timeout_s,
                    )
                    await on_expiry(self)
                    return
                await asyncio.sleep(remaining if not self.active_calls else self.idle_timeout_s)

        self.watchdog = asyncio.get_running_loop().create_task(watch())

    def stop_watchdog(self) -> None:
        if self.watchdog is not None and self.watchdog is not asyncio.current_task():
            self.watchdog.cancel()
        self.watchdog = None
