"""The vLLM backend's calls into its engine core (engines/vllm/core.py), with
a stand-in for vLLM's AsyncLLM: CI has no vLLM. A call in flight when the core
dies is never answered by vLLM itself; the engine must say it is dead."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engines.errors import EngineDeadError, EngineTimeoutError
from engines.vllm import core as vllm_core
from engines.vllm.core import CoreCalls


class VLLMDead(Exception):
    """vLLM's EngineDeadError."""


@pytest.fixture
def core(monkeypatch) -> CoreCalls:
    monkeypatch.setattr(vllm_core, "vllm_api", lambda: SimpleNamespace(EngineDeadError=VLLMDead))
    return CoreCalls(SimpleNamespace(errored=False), "e0")


def test_a_call_the_dead_core_never_answers_fails_as_dead(core):
    async def main():
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(setattr, core.llm, "errored", True)
        with pytest.raises(EngineDeadError, match="engine core is dead"):
            await core.call(never)  # no deadline: only the death can end it
        await asyncio.sleep(0)  # the cancellation lands
        assert never.cancelled()

    asyncio.run(main())


def test_a_call_past_its_deadline_times_out_naming_it(core):
    async def main():
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(
            EngineTimeoutError, match=r"collective_rpc\('x'\) took longer than 0.1s"
        ):
            await core.call(never, 0.1, "collective_rpc('x')")

    asyncio.run(main())


def test_an_answer_and_vllms_own_dead_error_pass_through(core):
    async def answer():
        return [1]

    async def dead():
        raise VLLMDead("gone")

    async def main():
        assert await core.call(answer(), 5) == [1]
        with pytest.raises(EngineDeadError, match="engine core died: gone"):
            await core.call(dead(), 5)

    asyncio.run(main())
