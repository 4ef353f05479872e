"""The vLLM backend's control of its engine, a class `VLLMEngine` inherits:
health, sleep and wake (with the wait for GPU room before a wake), pause
and resume (vLLM's own pause under the admission's door), the calls into
the workers (`collective_rpc`) and shutdown. Generation and start-up are
`engines.vllm.engine`'s.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any

import ray

from engines.base import RolloutEngine
from engines.config import EngineConfig
from engines.control import SLEEP_TAGS, check_sleep_level, wake_tags
from engines.errors import RequestError
from engines.lifecycle.placement import VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
from engines.vllm.api import vllm_api, worker_memory
from engines.vllm.core import CoreCalls
from engines.vllm.openai_app import AdmittedClient

#: How often `wait_gpu_room` looks at the GPU's free memory.
ROOM_POLL_S = 0.1


class VLLMControl(RolloutEngine):
    """Everything here acts on the AsyncLLM (`engine`) and its engine-core
    process (`_core`) that `VLLMEngine.__init__` starts."""

    engine: Any
    _core: CoreCalls
    sleep_mode: bool
    _slept_bytes: dict[str, int]
    #: The OpenAI app's engine client, once `_openai_app` built it.
    _http: AdmittedClient | None = None

    async def health(self) -> dict[str, Any]:
        self._core.raise_if_dead()
        info = self.base_health()
        info.update(
            num_unfinished_requests=await self.get_num_unfinished_requests(),
            paused=self._admission.closed,
            sleeping=sorted(self._asleep),
            vllm_version=vllm_api().vllm.__version__,
            pid=os.getpid(),
            engine_core_pids=self._core.pids(),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        # Asked of the workers themselves: with TP>1 they are other processes
        # on other GPUs than this actor sees.
        gpus = await self._on_workers(worker_memory)
        info["device"] = ",".join(gpu["device"] for gpu in gpus)
        info["gpus"] = gpus
        info["memory"] = {"used_bytes": sum(gpu["used_bytes"] for gpu in gpus)}
        return info

    async def reset_prefix_cache(self) -> bool:
        # Without prefix caching no KV outlives its request, so there is
        # nothing stale to drop, and vLLM's reset walks every KV block in
        # Python (v1/core/block_pool.py in v0.26.0) on every sync.
        if not self.engine.vllm_config.cache_config.enable_prefix_caching:
            return True
        return await self._core.call(self.engine.reset_prefix_cache())

    async def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        if not self.sleep_mode:
            raise RequestError(
                f"engine {self.config.name} was started without sleep mode: pass "
                "enable_sleep_mode=True to create_vllm_engines"
            )
        # "wait": requests in flight finish first (vLLM's default aborts them).
        # Level 1 offloads weights to CPU and drops the KV cache; level 2 drops both.
        before = await self._on_workers(worker_memory)
        await self._core.call(self.engine.sleep(level, mode="wait"))
        self._asleep = set(SLEEP_TAGS)
        gpus = await self._on_workers(worker_memory)
        after = {gpu["gpu_uuid"]: gpu["used_bytes"] for gpu in gpus}
        self._slept_bytes = {
            gpu["gpu_uuid"]: max(0, gpu["used_bytes"] - after.get(gpu["gpu_uuid"], 0))
            for gpu in before
        }

    async def wait_gpu_room(self, timeout_s: float) -> float:
        """Wait until each of this sleeping engine's GPUs has the room its
        wake-up takes back (what its sleep freed): on a GPU it shares with an
        engine that just died, that engine's memory is freed a moment after
        its death, and waking into it fails with CUDA's out of memory. Returns
        the seconds waited; past `timeout_s` it returns anyway."""
        began = time.monotonic()
        needed = self._slept_bytes
        while needed and time.monotonic() - began < timeout_s:
            gpus = await self._on_workers(worker_memory)
            if all(
                g["total_bytes"] - g["used_bytes"] >= needed.get(g["gpu_uuid"], 0) for g in gpus
            ):
                break
            await asyncio.sleep(ROOM_POLL_S)
        return time.monotonic() - began

    async def _await_room(self, config: EngineConfig, timeout_s: float) -> None:
        # The lost engine's core frees its memory a moment after its actor is
        # gone, and vLLM refuses to start while the free memory is below what
        # it asks for (`request_memory` in vllm/v1/worker/utils.py, v0.26.0).
        # Read through NVML: CUDA must not be initialised in this process.
        fraction = config.gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            free, total = device_memory(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0])
            if free >= math.ceil(total * fraction):
                return
            await asyncio.sleep(ROOM_POLL_S)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags_set = wake_tags(tags)
        if not tags_set & self._asleep:
            return  # awake already: no round trip to the engine core
        await self._core.call(self.engine.wake_up(sorted(tags_set & self._asleep)))
        self._asleep -= tags_set

    async def pause_generation(self, mode: str = "keep") -> None:
        await super().pause_generation(mode)
        if mode == "wait" and self.engine.model_config.is_multimodal_model:
            # Cached encoder outputs were computed with the weights about to be
            # replaced ("keep" and "abort" clear them inside vLLM's pause).
            await self._core.call(self.engine.reset_mm_cache())
            await self._core.call(self.engine.reset_encoder_cache())

    # Mode "wait" needs no call to the engine core: requests are held in this
    # actor, not inside vLLM, and those let in run to completion.
    async def _freeze(self) -> None:
        # vLLM's own "keep": the scheduler stops stepping, and (clear_cache)
        # running requests are preempted, so their KV cache is recomputed with
        # the weights served when they resume, as OpenRLHF's pause gets it.
        await self._core.call(self.engine.pause_generation(mode="keep"))

    async def _thaw(self) -> None:
        if self._http is not None:  # before vLLM steps again: tokens sampled so far
            self._http.mark_versions()
        await self._core.call(self.engine.resume_generation())

    async def _abort_requests(self) -> None:
        await self._core.call(self.engine.pause_generation(mode="abort"))
        # New requests wait in this actor until it reopens, not in vLLM.
        await self._core.call(self.engine.resume_generation())

    async def _on_workers(self, function: Any) -> list[Any]:
        """This backend's own call of `function` on every worker."""
        return await self._rpc(function, (), {}, self.config.rpc_timeout_s)

    async def _rpc(self, method: Any, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        # vLLM's single-process executor ignores its own `timeout`
        # (https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/v1/executor/uniproc_executor.py),
        # so the deadline is enforced here.
        call = self.engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        name = getattr(method, "__name__", method)
        return await self._core.call(call, timeout, f"collective_rpc({name!r})")

    async def shutdown(self) -> None:
        # Stops the engine-core process (and the Ray workers of TP>1), which
        # frees the GPU memory before the actor is killed.
        if self.prepared:  # no engine yet
            return
        await self._stop_openai()
        self.engine.shutdown()


def device_memory(device: str) -> tuple[int, int]:
    """Free and total bytes of `device` (an index or a UUID, as Ray writes
    CUDA_VISIBLE_DEVICES), from NVML."""
    from vllm.utils.import_utils import import_pynvml

    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        if device.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(device))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(device)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    finally:
        pynvml.nvmlShutdown()
