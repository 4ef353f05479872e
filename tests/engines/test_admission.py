"""Admission: the gate the vLLM engine actor closes around a weight sync."""

import asyncio

from engines.admission import Admission


def test_close_waits_for_requests_inside_and_holds_new_ones_until_open():
    async def scenario():
        gate = Admission()
        events = []

        async def request(name, seconds):
            async with gate.request():
                events.append(f"{name} in")
                await asyncio.sleep(seconds)
            events.append(f"{name} out")

        first = asyncio.create_task(request("first", 0.2))
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(gate.close())
        await asyncio.sleep(0.05)
        assert not closing.done(), "close returned with a request inside"
        late = asyncio.create_task(request("late", 0))
        await closing
        events.append("closed")
        await asyncio.sleep(0.1)
        assert not late.done(), "a request got in while closed"
        gate.open()
        await asyncio.gather(first, late)
        return events

    assert asyncio.run(scenario()) == ["first in", "first out", "closed", "late in", "late out"]


def test_close_returns_at_once_when_idle():
    async def scenario():
        gate = Admission()
        await asyncio.wait_for(gate.close(), timeout=1)
        gate.open()
        async with gate.request():
            pass

    asyncio.run(scenario())
