"""The GPU backend: vLLM's AsyncLLM inside the engine actor.

One AsyncLLM per actor, so concurrent `generate` calls into the actor join
vLLM's continuous batching. Its engine core runs in another process (always,
for AsyncLLM), forked from the actor's forkserver (`engines.forkserver`); its
GPU workers live there (`uni`, TP=1) or in Ray actors of
vLLM's Ray executor (TP>1) placed on this engine's bundles (see
`engines.vllm_engine.start_engine` and `engines.env.actor_env_vars`).

Only `engines.vllm_engine.backend_class` imports this module, and only for
backend "vllm": CPU code never needs vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from engines import env, forkserver
from engines.base import (
    SLEEP_TAGS,
    RolloutEngine,
    check_sleep_level,
    wait_turn,
    wake_tags,
    warn_vocab_mismatch,
)
from engines.config import EngineConfig
from engines.errors import (
    EngineDeadError,
    EngineTimeoutError,
    RequestError,
)
from engines.outputs import CompletionOutput, RequestOutput
from engines.sampling import SamplingParams
from engines.startup import OwnLog, StartupClock, actor_clock, vllm_log_phases

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMApi:
    """The parts of vLLM this backend uses."""

    vllm: Any
    RequestOutputKind: Any
    UsageContext: Any
    freeze_gc_heap: Any
    AsyncLLM: Any
    EngineDeadError: Any


@functools.cache
def vllm_api() -> VLLMApi:
    """vLLM, imported on first use: in the engine actor only, so the driver
    creates the actor from this module without paying vLLM's import (seconds
    of torch, transformers and vLLM itself, which sat on the start-up's
    critical path before the actor even existed)."""
    try:
        import vllm
        import vllm.v1.engine.utils as engine_utils
        from vllm.sampling_params import RequestOutputKind
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.gc_utils import freeze_gc_heap
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            f"the vLLM backend needs vLLM ({exc}); install it with: "
            "pip install 'rolloutflow[vllm]', or use backend='hf' (CPU)"
        ) from exc
    # In a Ray actor vLLM overrides every start method but spawn for its engine
    # core (`_maybe_force_spawn`, https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/utils/system_utils.py);
    # fork it from the server `VLLMEngine.__init__` started (engines/forkserver.py).
    engine_utils.get_mp_context = forkserver.context
    return VLLMApi(
        vllm=vllm,
        RequestOutputKind=RequestOutputKind,
        UsageContext=UsageContext,
        freeze_gc_heap=freeze_gc_heap,
        AsyncLLM=AsyncLLM,
        EngineDeadError=VLLMEngineDeadError,
    )


WORKER_EXTENSION = "engines.worker_extension.WeightSyncWorkerExtension"

#: How often a call waiting on the engine core checks that the core lives.
CORE_DEATH_POLL_S = 0.25

#: What vLLM's engine core imports as it starts (v0.26.0, one GPU), imported
#: in the forkserver while the actor imports its own side of vLLM.
ENGINE_CORE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
)

#: vLLM pads its embedding and LM-head rows to a multiple of this
#: (DEFAULT_VOCAB_PADDING_SIZE in model_executor/layers/vocab_parallel_embedding.py,
#: v0.26.0; tests/gpu/test_gpu_engines.py checks it). Importing that module
#: for it put 20 more vLLM modules (its custom ops among them) on the actor's start.
VOCAB_PADDING = 64


def padded_vocab_rows(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def vllm_sampling_params(value: Any) -> Any:
    """Our SamplingParams (or a dict, None, or a `vllm.SamplingParams` used as
    is) -> vLLM's, asking for the final output only: `generate` returns whole
    completions, so streaming partial outputs would be wasted work."""
    api = vllm_api()
    if isinstance(value, api.vllm.SamplingParams):
        params = value.clone()
    else:
        # Our fields are vLLM's, by name and meaning.
        params = api.vllm.SamplingParams(**SamplingParams.coerce(value).model_dump())
    params.output_kind = api.RequestOutputKind.FINAL_ONLY
    return params


def worker_memory(worker: Any) -> dict[str, Any]:
    """Runs inside each GPU worker (sent through `collective_rpc`): which GPU
    it computes on and that GPU's memory as the driver sees it, so sleep mode
    is measured on the device itself, not through an allocator's view."""
    import torch

    device = worker.device
    free, total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device)
    return {
        "rank": int(worker.rank),
        "device": str(device),
        "gpu_name": props.name,
        "gpu_uuid": str(props.uuid),
        "used_bytes": int(total - free),
        "total_bytes": int(total),
    }


#: How often `wait_gpu_room` looks at the GPU's free memory.
ROOM_POLL_S = 0.1


class VLLMEngine(RolloutEngine):
    backend = "vllm"

    def __init__(
        self,
        config: EngineConfig,
        clock: StartupClock | None = None,
        after: list[Any] | None = None,
    ):
        """`after`: wait for these before vLLM starts (`wait_turn`)."""
        clock = clock or actor_clock()
        if os.environ.get(env.VLLM_ENABLE_V1_MULTIPROCESSING, "1") != "0":  # else no core process
            forkserver.start(ENGINE_CORE_MODULES)
        api = vllm_api()
        clock.mark("vLLM imports")
        log = OwnLog()  # vLLM's engine core logs its own start-up split there
        super().__init__(config)
        kwargs = dict(config.engine_kwargs)
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        # Bytes the last sleep freed, per GPU UUID: what waking takes back.
        self._slept_bytes: dict[str, int] = {}
        # One GPU: the worker lives in the engine-core process ("uni"). More:
        # vLLM's Ray executor places one worker actor per bundle (the bundles
        # come from VLLM_RAY_BUNDLE_INDICES in this actor's runtime_env).
        kwargs.setdefault(
            "distributed_executor_backend", "uni" if config.tensor_parallel_size == 1 else "ray"
        )
        # vLLM logs throughput every few seconds by default; in an engine
        # actor those lines flood the driver's log. Callers may turn it back on.
        kwargs.setdefault("disable_log_stats", True)
        if config.gpu_memory_utilization is not None:  # None: vLLM's default
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        args = api.vllm.AsyncEngineArgs(
            model=config.pretrain,
            max_model_len=config.max_len,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size,
            enable_prefix_caching=config.enable_prefix_caching,
            worker_extension_cls=WORKER_EXTENSION,
            **kwargs,
        )
        # Blocks until the engine core is up (model loaded, KV cache allocated).
        # Rollouts are offline batch work, like `vllm.LLM`'s: its usage context
        # picks LLM's batch defaults (on an H200: max_num_seqs 1024, 16384
        # batched tokens; ENGINE_CONTEXT gets 128 and 2048; figures in
        # docs/benchmarks.md). get_batch_defaults in
        # https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/engine/arg_utils.py
        clock.mark("engine arguments")
        if after:
            wait_turn(after, env.ready_timeout_s(), config.name, clock)
        self.engine = api.AsyncLLM.from_engine_args(args, usage_context=api.UsageContext.LLM_CLASS)
        clock.mark("vLLM engine (tokenizer, weights, compile, CUDA graphs, KV cache)")
        # vLLM's own tokenizer (loaded once, by its renderer), not a second copy.
        # None with skip_tokenizer_init=True (token-id prompts only).
        self.tokenizer = self.engine.tokenizer
        vocab = self.engine.model_config.get_vocab_size()
        if self.tokenizer is not None:
            warn_vocab_mismatch(config.name, len(self.tokenizer), vocab, padded_vocab_rows(vocab))
        # This actor is the engine's front end, as vLLM's API server process
        # is: like it, keep the start-up heap (vLLM, torch, transformers) out
        # of the GC's oldest-generation scans, whose pauses stall the output
        # handler (https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/entrypoints/serve/utils/server_utils.py).
        api.freeze_gc_heap()
        logger.info(
            "engine %s: vLLM %s, %s, TP=%d, executor %s",
            config.name,
            api.vllm.__version__,
            config.pretrain,
            config.tensor_parallel_size,
            kwargs["distributed_executor_backend"],
        )
        clock.mark("after the engine")
        self.startup = clock.report(config.name, self.backend, vllm_log_phases(log.read()))

    # --- generation -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(
                f"engine {self.config.name} has no tokenizer (skip_tokenizer_init=True): "
                "send token ids to generate"
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _generate(self, prompts, sampling_params) -> list[RequestOutput]:
        try:
            params = vllm_sampling_params(sampling_params)
        except ValueError as exc:  # ours (pydantic) or vLLM's own checks
            raise RequestError(f"bad sampling parameters: {exc}") from exc
        # check_request reads only the prompts and the engine's state.
        self.check_request(prompts, params)
        # Waits while paused: a request queued inside vLLM would be stamped
        # with one version and run on the next. The ticket collects every
        # version served while the call is inside (a sync under frozen requests).
        async with self._admission.request() as ticket:
            self.check_request(prompts, params)  # a failed sync may have left it stale
            self._raise_if_dead()
            tasks = [asyncio.ensure_future(self._one(prompt, params)) for prompt in prompts]
            try:
                outputs = list(await asyncio.gather(*tasks))
            except BaseException:
                # One bad prompt (or a cancelled call) must not leave its siblings
                # generating for nobody: cancelling a task aborts its vLLM request.
                for task in tasks:
                    task.cancel()
                raise
            for output in outputs:
                output.weight_version, output.weight_versions = (
                    ticket.versions[0],
                    list(ticket.versions),
                )
            return outputs

    async def _one(self, prompt: list[int], params: Any) -> RequestOutput:
        request_id = uuid.uuid4().hex
        final = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": prompt}, params, request_id
            ):
                final = output
        except vllm_api().EngineDeadError as exc:
            raise EngineDeadError(
                f"engine {self.config.name}: vLLM's engine core died: {exc}",
                engine=self.config.name,
            ) from exc
        except ValueError as exc:  # vLLM's per-request validation
            raise RequestError(f"engine {self.config.name} rejected a prompt: {exc}") from exc
        if final is None or not final.finished:
            raise RequestError(f"engine {self.config.name}: request {request_id} did not finish")
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            outputs=[
                CompletionOutput(
                    index=completion.index,
                    token_ids=list(completion.token_ids),
                    text=completion.text,
                    finish_reason=completion.finish_reason,
                    # vLLM's own Logprob objects, passed through as they are.
                    logprobs=completion.logprobs,
                    cumulative_logprob=completion.cumulative_logprob,
                    stop_reason=completion.stop_reason,
                )
                for completion in sorted(final.outputs, key=lambda c: c.index)
            ],
            weight_version=0,  # stamped by `_generate` from the call's ticket
            engine=self.config.name,
            prompt_logprobs=final.prompt_logprobs,
            num_cached_tokens=final.num_cached_tokens,
        )

    async def get_num_unfinished_requests(self) -> int:
        # AsyncLLM has no public count; the output processor tracks every
        # request (n>1 counts each sample) until its final output is out.
        return self.engine.output_processor.get_num_unfinished_requests()

    # --- control ------------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self.engine.errored:
            raise EngineDeadError(
                f"engine {self.config.name}: vLLM's engine core is dead (see the actor's log)",
                engine=self.config.name,
            )

    async def health(self) -> dict[str, Any]:
        self._raise_if_dead()
        info = self.base_health()
        info.update(
            num_unfinished_requests=await self.get_num_unfinished_requests(),
            paused=self._admission.closed,
            sleeping=sorted(self._asleep),
            vllm_version=vllm_api().vllm.__version__,
            pid=os.getpid(),
            engine_core_pids=self._engine_core_pids(),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        # Asked of the workers themselves: with TP>1 they are other processes
        # on other GPUs than this actor sees.
        gpus = await self._rpc(worker_memory)
        info["device"] = ",".join(gpu["device"] for gpu in gpus)
        info["gpus"] = gpus
        info["memory"] = {"used_bytes": sum(gpu["used_bytes"] for gpu in gpus)}
        return info

    def _engine_core_pids(self) -> list[int]:
        """vLLM's engine-core processes (none when it runs in this process):
        AsyncMPClient's process manager, v0.26.0 (v1/engine/core_client.py)."""
        resources = getattr(self.engine.engine_core, "resources", None)
        processes = getattr(getattr(resources, "engine_manager", None), "processes", [])
        return [process.pid for process in processes]

    async def reset_prefix_cache(self) -> bool:
        # Without prefix caching no KV outlives its request, so there is
        # nothing stale to drop, and vLLM's reset walks every KV block in
        # Python (v1/core/block_pool.py in v0.26.0) on every sync.
        if not self.engine.vllm_config.cache_config.enable_prefix_caching:
            return True
        return await self._core(self.engine.reset_prefix_cache())

    async def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        if not self.sleep_mode:
            raise RequestError(
                f"engine {self.config.name} was started without sleep mode: pass "
                "enable_sleep_mode=True to create_vllm_engines"
            )
        # "wait": requests in flight finish first (vLLM's default aborts them).
        # Level 1 offloads weights to CPU and drops the KV cache; level 2 drops both.
        before = await self._rpc(worker_memory)
        await self._core(self.engine.sleep(level, mode="wait"))
        self._asleep = set(SLEEP_TAGS)
        after = {gpu["gpu_uuid"]: gpu["used_bytes"] for gpu in await self._rpc(worker_memory)}
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
            gpus = await self._rpc(worker_memory)
            if all(
                g["total_bytes"] - g["used_bytes"] >= needed.get(g["gpu_uuid"], 0) for g in gpus
            ):
                break
            await asyncio.sleep(ROOM_POLL_S)
        return time.monotonic() - began

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags_set = wake_tags(tags)
        if not tags_set & self._asleep:
            return  # awake already: no round trip to the engine core
        await self._core(self.engine.wake_up(sorted(tags_set & self._asleep)))
        self._asleep -= tags_set

    async def pause_generation(self, mode: str = "keep") -> None:
        await super().pause_generation(mode)
        if mode == "wait" and self.engine.model_config.is_multimodal_model:
            # Cached encoder outputs were computed with the weights about to be
            # replaced ("keep" and "abort" clear them inside vLLM's pause).
            await self._core(self.engine.reset_mm_cache())
            await self._core(self.engine.reset_encoder_cache())

    # Mode "wait" needs no call to the engine core: requests are held in this
    # actor, not inside vLLM, and those let in run to completion.
    async def _freeze(self) -> None:
        # vLLM's own "keep": the scheduler stops stepping, and (clear_cache)
        # running requests are preempted, so their KV cache is recomputed with
        # the weights served when they resume, as OpenRLHF's pause gets it.
        await self._core(self.engine.pause_generation(mode="keep"))

    async def _thaw(self) -> None:
        await self._core(self.engine.resume_generation())

    async def _abort_requests(self) -> None:
        await self._core(self.engine.pause_generation(mode="abort"))
        # New requests wait in this actor until it reopens, not in vLLM.
        await self._core(self.engine.resume_generation())

    async def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ):
        if not isinstance(method, str) or method.startswith("_"):
            raise RequestError(f"collective_rpc needs a public worker method name, got {method!r}")
        return await self._rpc(method, args, kwargs, timeout_s)

    async def _rpc(
        self,
        method: Any,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        timeout = self.config.rpc_timeout_s if timeout_s is None else timeout_s
        # vLLM's single-process executor ignores its own `timeout`
        # (https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/v1/executor/uniproc_executor.py),
        # so the deadline is enforced here.
        call = self.engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        name = getattr(method, "__name__", method)
        return await self._core(call, timeout, f"collective_rpc({name!r})")

    async def _core(self, call: Any, timeout_s: float | None = None, what: str = "") -> Any:
        """Await a call into vLLM's engine core; raise EngineDeadError as soon
        as the core is dead, EngineTimeoutError past `timeout_s`. A call in
        flight when the core process is killed is never answered (v0.26.0
        fails the requests' output streams, not its pending utility calls:
        `_call_utility_async` in v1/engine/core_client.py), so the core's
        death is watched beside it."""
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
                self._raise_if_dead()
                if deadline is not None and loop.time() >= deadline:
                    raise EngineTimeoutError(
                        f"engine {self.config.name}: {what or 'a call to the engine core'} "
                        f"took longer than {timeout_s:g}s",
                        engine=self.config.name,
                    )
        except vllm_api().EngineDeadError as exc:
            raise EngineDeadError(
                f"engine {self.config.name}: vLLM's engine core died: {exc}",
                engine=self.config.name,
            ) from exc
        finally:
            task.cancel()  # a no-op once it is done

    async def shutdown(self) -> None:
        # Stops the engine-core process (and the Ray workers of TP>1), which
        # frees the GPU memory before the actor is killed.
        self.engine.shutdown()
