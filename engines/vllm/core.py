"""Calls from the engine actor into vLLM's engine core, each watched for the
core's death and bounded by its deadline.

A call in flight when the core process is killed is never answered: vLLM
(v0.26.0) fails the requests' output streams, not its pending utility calls
(`_call_utility_async` in v1/engine/core_client.py). So every call is awaited
beside a look at whether the core still lives.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engines.errors import EngineDeadError, EngineTimeoutError
from engines.vllm.api import vllm_api

#: How often a call waiting on the engine core checks that the core lives.
CORE_DEATH_POLL_S = 0.25


class CoreCalls:
    """The engine core behind one AsyncLLM (`llm`), as engine `engine` calls it."""

    def __init__(self, llm: Any, engine: str):
        self.llm = llm
        self.engine = engine

    def raise_if_dead(self) -> None:
        if self.llm.errored:
            raise EngineDeadError(
                f"engine {self.engine}: vLLM's engine core is dead (see the actor's log)",
                engine=self.engine,
            )

    def died(self, exc: BaseException) -> EngineDeadError:
        """Ours, for vLLM's own EngineDeadError."""
        return EngineDeadError(
            f"engine {self.engine}: vLLM's engine core died: {exc}", engine=self.engine
        )

    async def call(self, call: Any, timeout_s: float | None = None, what: str = "") -> Any:
        """Await `call`; raise EngineDeadError as soon as the core is dead,
        EngineTimeoutError past `timeout_s` (naming the call as `what`)."""
        task = asyncio.ensure_future(call)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        try:
            while True:
                wait = CORE_DEATH_POLL_S
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - loop.time()))
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
                self.raise_if_dead()
                if deadline is not None and loop.time() >= deadline:
                    raise EngineTimeoutError(
                        f"engine {self.engine}: {what or 'a call to the engine core'} "
                        f"took longer than {timeout_s:g}s",
                        engine=self.engine,
                    )
        except vllm_api().EngineDeadError as exc:
            raise self.died(exc) from exc
        finally:
            task.cancel()  # a no-op once it is done

    def pids(self) -> list[int]:
        """vLLM's engine-core processes (none when it runs in this process):
        AsyncMPClient's process manager, v0.26.0 (v1/engine/core_client.py)."""
        resources = getattr(self.llm.engine_core, "resources", None)
        processes = getattr(getattr(resources, "engine_manager", None), "processes", [])
        return [process.pid for process in processes]
