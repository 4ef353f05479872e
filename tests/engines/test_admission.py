"""Admission: the door an engine actor closes around a weight sync, in the
three pause modes, with a stand-in backend that records what it was asked."""

import asyncio

import pytest

from engines.admission import Admission


class Backend:
    def __init__(self):
        self.calls = []
        self.version = 0

    def admission(self) -> Admission:
        async def record(name):
            self.calls.append(name)

        return Admission(
            freeze=lambda: record("freeze"),
            thaw=lambda: record("thaw"),
            abort=lambda: record("abort"),
            version=lambda: self.version,
        )


async def until(condition, timeout_s: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


async def request(gate: Admission, events: list, name: str, done: asyncio.Event):
    async with gate.request() as ticket:
        events.append(f"{name} in")
        await done.wait()
    events.append(f"{name} out")
    return ticket


def test_wait_mode_waits_for_requests_inside_and_holds_new_ones_until_open():
    async def scenario():
        backend = Backend()
        gate, events = backend.admission(), []
        finish_first, finish_late = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(request(gate, events, "first", finish_first))
        await until(lambda: events)
        closing = asyncio.create_task(gate.close("wait"))
        late = asyncio.create_task(request(gate, events, "late", finish_late))
        await asyncio.sleep(0)
        assert not closing.done(), "close returned with a request inside"
        finish_first.set()
        await closing
        events.append("closed")
        assert "late in" not in events
        await gate.open()
        finish_late.set()
        await asyncio.gather(first, late)
        return events, backend.calls

    events, calls = asyncio.run(scenario())
    assert events == ["first in", "first out", "closed", "late in", "late out"]
    assert calls == []  # "wait" never asks the backend


def test_keep_mode_freezes_without_waiting_and_records_the_new_version():
    async def scenario():
        backend = Backend()
        gate, events, finish = backend.admission(), [], asyncio.Event()
        inside = asyncio.create_task(request(gate, events, "a", finish))
        await until(lambda: events)
        await asyncio.wait_for(gate.close("keep"), 1)  # returns with the request frozen
        assert gate.closed and not inside.done()
        backend.version = 1  # a sync under the frozen request
        await gate.open()
        finish.set()
        return (await inside).versions, backend.calls

    versions, calls = asyncio.run(scenario())
    assert versions == [0, 1]
    assert calls == ["freeze", "thaw"]


def test_closes_nest_and_idle_keep_asks_nothing():
    """A trainer's pause around a sync's own pause and resume: the door opens
    at the outer resume; with nothing inside, no freeze round trip."""

    async def scenario():
        backend = Backend()
        gate = backend.admission()
        await gate.close("keep")
        await gate.close("keep")
        await gate.open()
        assert gate.closed
        await gate.open()
        assert not gate.closed
        await gate.open()  # an unmatched resume is a no-op
        async with gate.request() as ticket:
            pass
        return ticket.versions, backend.calls

    assert asyncio.run(scenario()) == ([0], [])


def test_abort_mode_ends_requests_and_a_bad_mode_changes_nothing():
    async def scenario():
        backend = Backend()
        gate, events, finish = backend.admission(), [], asyncio.Event()
        inside = asyncio.create_task(request(gate, events, "a", finish))
        await until(lambda: events)
        with pytest.raises(ValueError, match="'drain'"):
            await gate.close("drain")
        assert not gate.closed
        closing = asyncio.create_task(gate.close("abort"))
        await until(lambda: backend.calls)
        assert backend.calls == ["abort"] and not closing.done()
        finish.set()  # what the backend's abort makes the request do
        await closing
        await inside
        await gate.open()
        return backend.calls

    assert asyncio.run(scenario()) == ["abort"]


async def computed(gate: Admission, events: list, name: str, done: asyncio.Event):
    """A call whose work ends when `done` is set; "computed" is logged then,
    "released" once the call returns."""
    async with gate.request():
        events.append(f"{name} in")
        await done.wait()
        events.append(f"{name} computed")
    events.append(f"{name} released")


def test_a_verdict_holds_the_calls_inside_and_those_let_in_until_it_passes():
    async def scenario():
        gate, events = Backend().admission(), []
        frozen_done, late_done, after_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
        frozen = asyncio.create_task(computed(gate, events, "frozen", frozen_done))
        await until(lambda: "frozen in" in events)
        await gate.close("keep")
        gate.hold()  # a sync committed: its probe's verdict is pending
        await gate.open()
        late = asyncio.create_task(computed(gate, events, "late", late_done))
        await until(lambda: "late in" in events)
        frozen_done.set()
        late_done.set()
        await until(lambda: "frozen computed" in events and "late computed" in events)
        assert not frozen.done() and not late.done()
        assert not any(e.endswith("released") for e in events)
        gate.settle(None)
        await asyncio.gather(frozen, late)
        # The next call, after the verdict, is not held.
        after = asyncio.create_task(computed(gate, events, "after", after_done))
        after_done.set()
        await after
        return events

    events = asyncio.run(scenario())
    assert events[-3:] == ["after in", "after computed", "after released"]
    assert {"frozen released", "late released"} <= set(events)


def test_a_failed_verdict_fails_every_held_call():
    async def scenario():
        gate, events, done = Backend().admission(), [], asyncio.Event()
        await gate.close("keep")
        gate.hold()
        await gate.open()
        calls = [asyncio.create_task(computed(gate, events, n, done)) for n in ("a", "b")]
        await until(lambda: events.count("a in") + events.count("b in") == 2)
        done.set()
        await until(lambda: len(events) == 4)  # both computed, neither released
        error = RuntimeError("engine e0: its probe failed")
        gate.settle(error)
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        return events, outcomes, error

    events, outcomes, error = asyncio.run(scenario())
    assert outcomes == [error, error]
    assert not any(e.endswith("released") for e in events)


def test_an_error_on_weights_that_fail_their_probe_is_the_verdicts():
    """Corrupted weights may fail the work itself (NaN logits): the call
    raises the verdict's error, not its own; after a passing verdict, its own."""

    async def failing(gate: Admission, started: asyncio.Event, go: asyncio.Event):
        async with gate.request():
            started.set()
            await go.wait()
            raise ValueError("probability tensor contains nan")

    async def scenario(verdict: BaseException | None):
        gate, started, go = Backend().admission(), asyncio.Event(), asyncio.Event()
        gate.hold()
        call = asyncio.create_task(failing(gate, started, go))
        await started.wait()
        go.set()
        await asyncio.sleep(0)
        assert not call.done()  # its error waits for the verdict too
        gate.settle(verdict)
        return (await asyncio.gather(call, return_exceptions=True))[0]

    stale = RuntimeError("engine e0: its probe failed")
    assert asyncio.run(scenario(stale)) is stale
    assert isinstance(asyncio.run(scenario(None)), ValueError)
