"""The GPU backend: vLLM's AsyncLLM inside the engine actor.

One AsyncLLM per actor, so concurrent `generate` calls into the actor join
vLLM's continuous batching. Its engine core runs in another process (always,
for AsyncLLM), forked from the actor's forkserver (`engines.vllm.forkserver`);
its GPU workers live there (`uni`, TP=1) or in Ray actors of vLLM's Ray
executor (TP>1) placed on this engine's bundles (see `engines.env.actor_env_vars`).

vLLM itself is imported as the engine starts (`engines.vllm.api`): CPU code
imports this module without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ray

from engines import env
from engines.base import (
    SLEEP_TAGS,
    RolloutEngine,
    check_sleep_level,
    wait_turn,
    wake_tags,
    warn_vocab_mismatch,
)
from engines.config import EngineConfig
from engines.errors import RequestError
from engines.load import EngineLoad
from engines.outputs import RequestOutput
from engines.startup import StartupClock, actor_clock
from engines.vllm import forkserver
from engines.vllm.adapters import lora_request
from engines.vllm.api import (
    VLLMApi,
    padded_vocab_rows,
    request_output,
    vllm_api,
    vllm_sampling_params,
    worker_memory,
)
from engines.vllm.core import CoreCalls
from engines.vllm.load import SchedulerLoad
from engines.vllm.openai_app import AdmittedClient, openai_app
from engines.vllm.startup_log import OwnLog, vllm_log_phases
from engines.weight_sync.lora.engine import adapter_versions

logger = logging.getLogger(__name__)


WORKER_EXTENSION = "engines.worker_extension.WeightSyncWorkerExtension"

#: What vLLM's engine core imports as it starts (v0.26.0, one GPU), imported
#: in the forkserver while the actor imports its own side of vLLM.
ENGINE_CORE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
)

#: How often `wait_gpu_room` looks at the GPU's free memory.
ROOM_POLL_S = 0.1


def engine_args(api: VLLMApi, config: EngineConfig) -> Any:
    """vLLM's AsyncEngineArgs for this engine: its config, then the caller's
    engine arguments."""
    kwargs = dict(config.engine_kwargs)
    if config.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=config.max_lora_rank)
        # Room for the adapter served while the next one loads (weight_sync/lora/).
        kwargs.setdefault("max_cpu_loras", kwargs.get("max_loras", 1) + 1)
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
    if config.quantization is not None:  # None: as the checkpoint says
        kwargs["quantization"] = config.quantization
    return api.vllm.AsyncEngineArgs(
        model=config.pretrain,
        max_model_len=config.max_len,
        seed=config.seed,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_prefix_caching=config.enable_prefix_caching,
        worker_extension_cls=WORKER_EXTENSION,
        **kwargs,
    )


class VLLMEngine(RolloutEngine):
    backend = "vllm"
    #: The OpenAI app's engine client, once `_openai_app` built it.
    _http: AdmittedClient | None = None

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
        self.sleep_mode = bool(config.engine_kwargs.get("enable_sleep_mode", False))
        # Bytes the last sleep freed, per GPU UUID: what waking takes back.
        self._slept_bytes: dict[str, int] = {}
        args = engine_args(api, config)
        # Blocks until the engine core is up (model loaded, KV cache allocated).
        # Rollouts are offline batch work, like `vllm.LLM`'s: its usage context
        # picks LLM's batch defaults (on an H200: max_num_seqs 1024, 16384
        # batched tokens; ENGINE_CONTEXT gets 128 and 2048; figures in
        # docs/history/benchmarks-diary.md). get_batch_defaults in
        # https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/engine/arg_utils.py
        clock.mark("engine arguments")
        if after:
            wait_turn(after, env.ready_timeout_s(), config.name, clock)
        self._load = SchedulerLoad()  # what the dispatcher admits work by
        self.engine = api.AsyncLLM.from_engine_args(
            args, usage_context=api.UsageContext.LLM_CLASS, stat_loggers=[self._load.stat_logger()]
        )
        self._core = CoreCalls(self.engine, config.name)
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
            args.distributed_executor_backend,
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
            self._core.raise_if_dead()
            with self._adapter(ticket.versions[0]) as adapter:
                tasks = [
                    asyncio.ensure_future(self._one(prompt, params, adapter)) for prompt in prompts
                ]
                try:
                    outputs = list(await asyncio.gather(*tasks))
                except BaseException:
                    # One bad prompt (or a cancelled call) must not leave its siblings
                    # generating for nobody: cancelling a task aborts its vLLM request.
                    for task in tasks:
                        task.cancel()
                    raise
            # With LoRA a request keeps its adapter (and the base) through syncs.
            versions = ticket.versions[:1] if self.config.enable_lora else list(ticket.versions)
            for output in outputs:
                output.weight_version, output.weight_versions = versions[0], list(versions)
            return outputs

    @contextlib.contextmanager
    def _adapter(self, version: int) -> Iterator[Any]:
        """The LoRARequest of the adapter served at `version` (None: the base
        model, or no LoRA), held while the call's requests run."""
        if not self.config.enable_lora:
            yield None
            return
        with adapter_versions(self.weights).pinned(version) as adapter:
            yield None if adapter is None else lora_request(adapter)

    async def _one(self, prompt: list[int], params: Any, adapter: Any = None) -> RequestOutput:
        request_id = uuid.uuid4().hex
        final = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": prompt}, params, request_id, lora_request=adapter
            ):
                final = output
        except vllm_api().EngineDeadError as exc:
            raise self._core.died(exc) from exc
        except ValueError as exc:  # vLLM's per-request validation
            # Not chained: VLLMValidationError does not unpickle (its __init__
            # takes more than the message), and Ray then sends RaySystemError.
            raise RequestError(f"engine {self.config.name} rejected a request: {exc}") from None
        if final is None or not final.finished:
            raise RequestError(f"engine {self.config.name}: request {request_id} did not finish")
        # Its weight version is stamped by `_generate`, from the call's ticket.
        return request_output(final, request_id, prompt, self.config.name)

    async def get_num_unfinished_requests(self) -> int:
        # AsyncLLM has no public count; the output processor tracks every
        # request (n>1 counts each sample) until its final output is out.
        return self.engine.output_processor.get_num_unfinished_requests()

    def _openai_app(self) -> Any:
        """vLLM's own OpenAI app on this engine's AsyncLLM (engines/vllm/openai_app.py).
        Bound to the AsyncLLM it is built on: build it again after a `restart`."""
        app, self._http = openai_app(self)
        return app

    async def load(self) -> EngineLoad:
        return self._load.load(self.engine.output_processor.get_num_unfinished_requests())

    # --- control ------------------------------------------------------------------
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

    async def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        if self._admission.frozen or self._asleep:
            # Frozen after the sync's resume: a caller's own pause around the
            # sync keeps vLLM from scheduling any request ("keep") until the
            # caller resumes, after the sync returns. An engine still asleep
            # (a sync that did not wake it) has no KV cache.
            return None
        api = vllm_api()
        params = api.vllm.SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False
        )
        params.output_kind = api.RequestOutputKind.FINAL_ONLY
        output = await asyncio.wait_for(
            self._one(list(token_ids), params), self.config.rpc_timeout_s
        )
        if output.prompt_logprobs is None:  # aborted before its prefill (a pause "abort")
            return None
        # Position 0 has no logprob; each other holds its own token's.
        positions = output.prompt_logprobs[1:]
        return [p[t].logprob for p, t in zip(positions, token_ids[1:], strict=True)]

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
        await self._stop_openai()
        self.engine.shutdown()
