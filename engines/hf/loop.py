"""The CPU backend's generation thread: the queue of requests, the batch it
runs (`engines.hf.batch`), and the pause flags it obeys between two steps.

Static batching: requests arriving mid-batch wait for the next batch; a
request is answered as soon as its own samples end, not when its batch does
(a long-tailed batch would hold every short answer back). The actor's event
loop submits, pauses and stops; the thread answers each request's future on
that loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engines.errors import EngineDeadError
from engines.outputs import RequestOutput

if TYPE_CHECKING:
    from engines.hf.batch import Request

logger = logging.getLogger(__name__)

#: Runs one batch; the first callable it is given says, between two steps,
#: whether to go on (False: the batch is aborted, or the engine shuts down);
#: the second answers one request whose samples all ended.
Answer = Callable[["Request", RequestOutput], None]
RunBatch = Callable[["list[Request]", Callable[[], bool], Answer], list[RequestOutput]]


class GenerationLoop:
    """The generation thread and the state it shares with the actor."""

    def __init__(self, engine: str, max_num_seqs: int, run_batch: RunBatch):
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self._run_batch = run_batch
        # Shared with the generation thread, under `_cond`: the queue, the
        # batch running, and the pause flags it obeys between two steps.
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        # Work run on this thread ahead of the next step (a sync's probe).
        self._jobs: list[tuple[Callable[[], Any], Future]] = []
        self._batch: list[Request] = []  # the batch running
        self.running = 0  # requests in it
        self.running_seqs = 0  # their sequences (n each)
        self._stepping = False  # the thread is inside a step (a forward pass and sampling)
        self._frozen = False  # pause "keep": park before the next step
        self._aborting = False  # pause "abort": end the batch running
        self._stopping = False
        self._thread_error: BaseException | None = None
        self._ended = False  # the thread is gone: nothing queued would run
        self.thread = threading.Thread(target=self._serve, name="hf-generate", daemon=True)
        self.thread.start()

    # --- from the actor ---------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        with self._cond:
            if self._ended:  # since the caller's `raise_if_dead`: nothing would run them
                raise self.dead_error()
            self._pending.extend(requests)
            self._cond.notify_all()

    def run_between_steps(self, job: Callable[[], Any]) -> Future:
        """Run `job` on the generation thread before its next step (at once
        when idle, frozen or not): a sync's probe goes ahead of the batch's
        next step instead of waiting for the batch to end."""
        future: Future = Future()
        with self._cond:
            if self._ended:
                raise self.dead_error()
            self._jobs.append((job, future))
            self._cond.notify_all()
        return future

    def unfinished(self) -> int:
        """Requests queued or running, less those already answered: a caller
        that has its (aborted) output never sees its request counted."""
        with self._cond:
            return len(self._pending) + sum(not r.answered for r in self._batch)

    def sequences(self) -> tuple[int, int]:
        """Sequences in the batch running, and queued for a later one."""
        with self._cond:
            return self.running_seqs, sum(request.params.n for request in self._pending)

    def freeze(self) -> None:
        """Park the thread before its next step; returns once it is in none
        (blocking: the actor runs it in a thread)."""
        with self._cond:
            self._frozen = True
            while self._stepping:
                self._cond.wait()

    def thaw(self) -> None:
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    def abort(self, aborted: Callable[[Request], RequestOutput]) -> None:
        """End the batch running at its next step, and answer every queued
        request now with `aborted(request)` (on the actor's event loop)."""
        with self._cond:
            queued, self._pending = self._pending, []
            self._aborting = bool(self.running)
            self._cond.notify_all()
        for request in queued:
            _resolve(request.future, aborted(request), None)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def raise_if_dead(self) -> None:
        if self._ended or not self.thread.is_alive():
            raise self.dead_error()

    def dead_error(self) -> EngineDeadError:
        cause = "" if self._thread_error is None else f": {self._thread_error!r}"
        return EngineDeadError(
            f"engine {self.engine}'s generation thread ended{cause}", engine=self.engine
        )

    # --- the generation thread ----------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                with self._cond:
                    while (
                        not self._stopping
                        and not self._jobs
                        and (not self._pending or self._frozen)
                    ):
                        self._cond.wait()
                    if self._stopping:
                        return
                    if self._jobs:
                        self._run_jobs()
                        continue
                    batch = self._batch = self._take_batch()
                    self.running = len(batch)
                    self.running_seqs = sum(request.params.n for request in batch)
                    self._stepping = True
                try:
                    outputs = self._run_batch(batch, self._next_step, _answer)
                    for request, output in zip(batch, outputs, strict=True):
                        if not request.answered:
                            _answer(request, output)
                except Exception as exc:  # noqa: BLE001 - handed to each caller
                    logger.exception("engine %s: batch failed", self.engine)
                    for request in batch:
                        if not request.answered:
                            request.loop.call_soon_threadsafe(_resolve, request.future, None, exc)
                finally:
                    with self._cond:
                        self.running = self.running_seqs = 0
                        self._batch = []
                        self._stepping = self._aborting = False
                        self._cond.notify_all()
        except BaseException as exc:
            self._thread_error = exc
            raise
        finally:
            self._fail_queued()

    def _take_batch(self) -> list[Request]:
        batch, seqs = [], 0
        while self._pending:
            if batch and seqs + self._pending[0].params.n > self.max_num_seqs:
                break
            request = self._pending.pop(0)
            batch.append(request)
            seqs += request.params.n
        return batch

    def _fail_queued(self) -> None:
        """The generation thread is ending: nothing will run what is queued,
        so its callers learn now that the engine is dead, not at their deadline."""
        with self._cond:
            self._ended = True
            queued, self._pending = self._pending, []
            jobs, self._jobs = self._jobs, []
        for request in queued:
            request.loop.call_soon_threadsafe(_resolve, request.future, None, self.dead_error())
        for _, future in jobs:
            future.set_exception(self.dead_error())

    def _run_jobs(self) -> None:
        """Run the jobs queued (called under `_cond`, released while they run)."""
        jobs, self._jobs = self._jobs, []
        self._cond.release()
        try:
            for job, future in jobs:
                try:
                    future.set_result(job())
                except Exception as exc:  # noqa: BLE001 - the job's caller gets it
                    future.set_exception(exc)
        finally:
            self._cond.acquire()

    def _next_step(self) -> bool:
        """Between two steps: park while frozen; False when the batch is aborted."""
        with self._cond:
            self._stepping = False
            self._cond.notify_all()
            while self._jobs or (self._frozen and not (self._stopping or self._aborting)):
                if self._jobs:
                    self._run_jobs()
                else:
                    self._cond.wait()
            self._stepping = True
            return not (self._stopping or self._aborting)


def _answer(request: Request, output: RequestOutput) -> None:
    """Answer once: the caller's event loop may be gone after (a caller of
    `asyncio.run` per request)."""
    request.answered = True
    request.loop.call_soon_threadsafe(_resolve, request.future, output, None)


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
