"""The CPU backend's generation thread (engines/hf/loop.py): work run between
two steps (a sync's probe) goes ahead of the batch's next step, and runs at
once on an idle or frozen thread. A stand-in batch logs its steps."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from engines.hf.loop import GenerationLoop

TIMEOUT_S = 10


def test_a_job_runs_before_the_batchs_next_step_not_after_the_batch():
    log: list[str] = []
    first_step, go_on = threading.Event(), threading.Event()

    def run_batch(batch, next_step, answer):
        for i in range(3):
            log.append(f"step {i}")
            if i == 0:
                first_step.set()
                go_on.wait(TIMEOUT_S)
            if not next_step():
                break
        return [None for _ in batch]

    async def scenario():
        loop = GenerationLoop("e0", 4, run_batch)
        here = asyncio.get_running_loop()
        request = SimpleNamespace(
            params=SimpleNamespace(n=1), answered=False, loop=here, future=here.create_future()
        )
        loop.submit([request])
        await asyncio.to_thread(first_step.wait, TIMEOUT_S)
        job = loop.run_between_steps(lambda: log.append("job") or "probed")
        go_on.set()
        answer = await asyncio.wait_for(asyncio.wrap_future(job), TIMEOUT_S)
        await asyncio.wait_for(request.future, TIMEOUT_S)
        loop.stop()
        return answer

    assert asyncio.run(scenario()) == "probed"
    assert log == ["step 0", "job", "step 1", "step 2"]


def test_a_job_runs_at_once_on_an_idle_or_frozen_thread_and_its_error_is_the_callers():
    loop = GenerationLoop("e0", 4, lambda batch, next_step, answer: [])
    try:
        assert loop.run_between_steps(lambda: 1).result(TIMEOUT_S) == 1
        loop.freeze()  # pause "keep" with nothing running: parked until thawed
        assert loop.run_between_steps(lambda: 2).result(TIMEOUT_S) == 2

        def fails():
            raise ValueError("nan logits")

        error = loop.run_between_steps(fails).exception(TIMEOUT_S)
        assert isinstance(error, ValueError) and loop.thread.is_alive()
    finally:
        loop.stop()


def test_an_answered_request_is_not_counted_while_its_batch_winds_down():
    """The batch answers a request (an aborted one) before it resets its
    bookkeeping: a caller holding that answer must not see it as unfinished."""
    answered, release = threading.Event(), threading.Event()

    def run_batch(batch, next_step, answer):
        answer(batch[0], "first")
        answered.set()
        release.wait(TIMEOUT_S)  # the thread has not left the batch yet
        return [None for _ in batch]

    async def scenario():
        loop = GenerationLoop("e0", 4, run_batch)
        here = asyncio.get_running_loop()
        requests = [
            SimpleNamespace(
                params=SimpleNamespace(n=1), answered=False, loop=here, future=here.create_future()
            )
            for _ in range(2)
        ]
        loop.submit(requests)
        assert await asyncio.wait_for(requests[0].future, TIMEOUT_S) == "first"
        await asyncio.to_thread(answered.wait, TIMEOUT_S)
        counted = loop.unfinished()
        release.set()
        await asyncio.wait_for(requests[1].future, TIMEOUT_S)
        loop.stop()
        return counted

    assert asyncio.run(scenario()) == 1
