"""The vLLM backend's calls into its engine core (`VLLMEngine._core`), with a
stand-in for vLLM's AsyncLLM: CI has no vLLM. A call in flight when the core
dies is never answered by vLLM itself; the engine must say it is dead."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engines import vllm_backend
from engines.errors import EngineDeadError, EngineTimeoutError
from engines.vllm_backend import VLLMEngine


class VLLMDead(Exception):
    """vLLM's EngineDeadError."""


@pytest.fixture
def engine(monkeypatch) -> VLLMEngine:
    monkeypatch.setattr(vllm_backend, "vllm_api", lambda: SimpleNamespace(EngineDeadError=VLLMDead))
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM to start
    engine.config = SimpleNamespace(name="e0")
    engine.engine = SimpleNamespace(errored=False)
    return engine


def test_a_call_the_dead_core_never_answers_fails_as_dead(engine):
    async def main():
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(setattr, engine.engine, "errored", True)
        with pytest.raises(EngineDeadError, match="engine core is dead"):
            await engine._core(never)  # no deadline: only the death can end it
        await asyncio.sleep(0)  # the cancellation lands
        assert never.cancelled()

    asyncio.run(main())


def test_a_call_past_its_deadline_times_out_naming_it(engine):
    async def main():
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(
            EngineTimeoutError, match=r"collective_rpc\('x'\) took longer than 0.1s"
        ):
            await engine._core(never, 0.1, "collective_rpc('x')")

    asyncio.run(main())


def test_an_answer_and_vllms_own_dead_error_pass_through(engine):
    async def answer():
        return [1]

    async def dead():
        raise VLLMDead("gone")

    async def main():
        assert await engine._core(answer(), 5) == [1]
        with pytest.raises(EngineDeadError, match="engine core died: gone"):
            await engine._core(dead(), 5)

    asyncio.run(main())


def gpu_readings(engine, monkeypatch, used: list[int], total: int = 100) -> list[int]:
    """The engine's GPU memory as `worker_memory` reports it: the next of
    `used` per call (the last one from then on); returns the readings taken."""
    taken: list[int] = []

    async def rpc(method, *args, **kwargs):
        taken.append(used[min(len(taken), len(used) - 1)])
        return [{"gpu_uuid": "GPU-a", "used_bytes": taken[-1], "total_bytes": total}]

    async def sleep(level, mode):
        pass

    monkeypatch.setattr(engine, "_rpc", rpc)
    monkeypatch.setattr(vllm_backend, "ROOM_POLL_S", 0.0)
    engine.sleep_mode = True
    engine._slept_bytes = {}
    engine.engine.sleep = sleep
    return taken


def test_a_spare_wakes_once_its_gpu_has_the_room_its_sleep_freed(engine, monkeypatch):
    # Asleep it frees 40 (60 -> 20); then an engine beside it dies and its
    # memory goes in steps: free 30, 35, then 60 >= 40.
    taken = gpu_readings(engine, monkeypatch, [60, 20, 70, 65, 40, 10])

    async def main():
        await engine.sleep(1)
        await engine.wait_gpu_room(timeout_s=5)

    asyncio.run(main())
    assert taken == [60, 20, 70, 65, 40]  # it looked until the room was there, and no longer


def test_waiting_for_room_ends_at_its_deadline(engine, monkeypatch):
    gpu_readings(engine, monkeypatch, [60, 20, 95])

    async def main():
        await engine.sleep(1)
        return await engine.wait_gpu_room(timeout_s=0.2)

    assert 0.2 <= asyncio.run(main()) < 2
