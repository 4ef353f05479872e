"""How an engine's open sync ends without committing (`SessionAbort`,
between `engine_weights.EngineWeights` and `session.WeightSync`): on the
caller's word, on a failed step, or when the trainer goes silent. The
weights are restored from the backup or the engine is marked stale, and
generation resumes, so requests get a clear error instead of a hang.
"""

from __future__ import annotations

import asyncio
import logging

from engines.weight_sync.engine_weights import EngineWeights
from engines.weight_sync.open_sync import OpenSync
from engines.weight_sync.protocol import Aborted, EngineHost

logger = logging.getLogger(__name__)


class SessionAbort(EngineWeights):
    """The engine's open sync (`open`, one at a time) and its abort; the
    lock is held by a step that calls the workers, so an abort waits for it."""

    def __init__(self, host: EngineHost):
        super().__init__(host)
        self.open: OpenSync | None = None
        self._lock = asyncio.Lock()

    async def abort_weight_sync(self, reason: str = "aborted by the caller") -> Aborted:
        """End the open sync without committing: restore the backup or mark the
        engine stale, then resume. Idempotent (no session: nothing to do)."""
        if self.open is None:
            # A failed receive aborts its sync itself and restores under the
            # lock: answer once that is done, with the engine as the restore
            # leaves it (marked stale until then).
            async with self._lock:
                return Aborted(self.name, False, self.host.stale, self.host.weight_version)
        return await self._abort(self.open, reason)

    async def _expire(self, session: OpenSync) -> None:
        if self.open is session:
            await self._abort(session, "the trainer went silent (idle deadline passed)")

    async def _abort(self, session: OpenSync, reason: str, locked: bool = False) -> Aborted:
        host = self.host
        if self.open is not session:  # already closed
            return Aborted(self.name, False, host.stale, host.weight_version)
        self.open = None
        session.stop_watchdog()
        was_stale = host.stale
        # Stale until we know better: a receive still running may load more.
        host.stale = True
        restored = False
        try:
            if locked:
                restored = await self._end_after_failure(session)
            else:
                async with self._lock:  # waits for a receive in flight
                    restored = await self._end_after_failure(session)
        finally:
            if restored or not session.touched:
                host.stale = was_stale
            await host.resume_generation()
        logger.error(
            "engine %s: weight sync to version %d aborted (%s); serving version %d%s",
            self.name,
            session.version,
            reason,
            host.weight_version,
            " (restored)" if restored else (" - STALE, resync needed" if host.stale else ""),
        )
        return Aborted(self.name, True, host.stale, host.weight_version, restored)

    async def _end_after_failure(self, session: OpenSync) -> bool:
        restore = session.touched and session.on_failure == "restore"
        try:
            results = await self.rpc("end_weight_sync", restore, True)
        except Exception:  # noqa: BLE001 - the engine stays stale; reported in the log
            logger.exception("engine %s: restoring weights failed", self.name)
            return False
        return restore and all(r["restored"] for r in results)
