"""Admission of requests into an engine actor, closed while its weights change.

The contract the weight sync relies on: **when `close()` returns, no request
is running a forward pass, and none starts one until `open()`.** How requests
already in are handled is the pause mode (vLLM's names):

- "keep": the backend freezes them between two steps; they continue after
  `open()`. A frozen request counts as quiescent: a sync may load weights
  under it. Both backends then recompute a frozen request's KV cache before
  its next step, so no token after the sync is computed from old keys and
  values (vLLM: `pause_generation(mode="keep")` clears its caches).
- "wait": they run to completion first.
- "abort": the backend ends them at once (finish_reason "abort"), as vLLM does.

New requests wait at the door in every mode. Closes nest: the door opens at
the `open()` matching the first `close()` (a trainer's own pause around a
sync's pause and resume); a nested close only waits for the first to have
taken effect (and aborts, in mode "abort").

Each admitted call holds a `Ticket` whose `versions` are the weight versions
served while it was inside: `open()` appends the version then served to every
ticket still inside, so an output frozen across a sync says so.

Outputs held for a verdict: a sync with a probe (`weight_sync.probe`) commits
and lets work in at once, the probe riding along, but what is computed on
the new weights must not leave before the probe's verdict. `hold()` (before
the door opens) ties every ticket inside, and every one admitted until
`settle()`, to that verdict; `released(ticket)` waits for it and raises the
verdict's error. A call's `request()` block ends there: its outputs are
released, or it raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

PAUSE_MODES = ("keep", "wait", "abort")


@dataclass(eq=False)  # one per call, by identity
class Ticket:
    versions: list[int] = field(default_factory=list)
    #: The probes' verdicts its outputs wait for: each resolves to None
    #: (passed) or to the error the call raises instead of answering.
    verdicts: list[asyncio.Future] = field(default_factory=list)


Step = Callable[[], Awaitable[None]]


async def released(ticket: Ticket) -> None:
    """Return once `ticket`'s outputs may leave; raise the error of a
    verdict against them."""
    for verdict in ticket.verdicts:
        # Shielded: a call cancelled while it waits leaves the verdict to the others.
        error = await asyncio.shield(verdict)
        if error is not None:
            raise error.with_traceback(None)  # one error for every held call: no shared traceback


class Admission:
    """`freeze` stops every request in flight between two steps and returns
    once none is in one; `thaw` lets them continue; `abort` ends them now
    (finish_reason "abort"); `version` is the weight version served."""

    def __init__(self, *, freeze: Step, thaw: Step, abort: Step, version: Callable[[], int]):
        self._freeze, self._thaw, self._abort_requests = freeze, thaw, abort
        self._version = version
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tickets: set[Ticket] = set()
        self._closes = 0
        self._frozen = False
        self._quiet: Awaitable[None] | None = None  # the first close, while it runs
        self._verdict: asyncio.Future | None = None  # while a probe runs

    @property
    def closed(self) -> bool:
        return self._closes > 0

    @property
    def frozen(self) -> bool:
        """Requests are frozen inside the backend (a "keep" close with work in flight)."""
        return self._frozen

    @asynccontextmanager
    async def request(self, hold: bool = True):
        """Wait until admission is open, then hold a place (and a Ticket
        stamped with the version served) until the block ends; with `hold`,
        the block then waits for the ticket's verdicts (`released`), when it
        returns or raises an error (weights that fail their probe may fail
        the work too: their error is the stale engine's). A caller that
        sends its outputs itself passes False and waits before each send."""
        while not self._open.is_set():
            await self._open.wait()
        ticket = Ticket([self._version()])
        if self._verdict is not None:
            ticket.verdicts.append(self._verdict)
        self._tickets.add(ticket)
        self._idle.clear()
        try:
            yield ticket
        except Exception:
            self._leave(ticket)
            if hold:
                await released(ticket)
            raise
        except BaseException:  # cancelled: nobody waits for an answer
            self._leave(ticket)
            raise
        self._leave(ticket)
        if hold:  # its work is done (a later sync need not wait for it): now its verdict
            await released(ticket)

    def _leave(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        if not self._tickets:
            self._idle.set()

    def hold(self) -> None:
        """Hold the outputs of every call inside, and of every call admitted
        from now, until `settle`."""
        verdict = asyncio.get_running_loop().create_future()
        for ticket in self._tickets:
            ticket.verdicts.append(verdict)
        self._verdict = verdict

    def settle(self, error: BaseException | None) -> None:
        """The verdict on the outputs held: released (None), or each of their
        calls raises `error`."""
        verdict, self._verdict = self._verdict, None
        if verdict is not None:
            verdict.set_result(error)

    async def close(self, mode: str = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._closes += 1
        self._open.clear()
        try:
            if self._closes > 1:
                if self._quiet is not None:
                    await asyncio.shield(self._quiet)
                if mode == "abort":
                    await self._abort()
                return
            self._quiet = asyncio.ensure_future(self._quiesce(mode))
            await asyncio.shield(self._quiet)
        except BaseException:
            await self.open()
            raise

    async def _quiesce(self, mode: str) -> None:
        if not self._tickets:
            return  # nothing in flight: no round trip to the engine (a sync's fast path)
        if mode == "keep":
            await self._freeze()
            self._frozen = True
        elif mode == "abort":
            await self._abort()
        else:
            await self._idle.wait()

    async def _abort(self) -> None:
        # Frozen requests are ended where they are, never thawed first: a sync
        # may be loading weights under them.
        await self._abort_requests()
        await self._idle.wait()

    async def open(self) -> None:
        """Undo one `close()`; the last one lets requests continue and in."""
        if self._closes == 0:
            return
        self._closes -= 1
        if self._closes:
            return
        self._quiet = None
        served = self._version()
        for ticket in self._tickets:
            if ticket.versions[-1] != served:
                ticket.versions.append(served)
        if self._frozen:
            self._frozen = False
            await self._thaw()
        self._open.set()
