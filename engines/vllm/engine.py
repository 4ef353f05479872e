"""The GPU backend: vLLM's AsyncLLM inside the engine actor.

One AsyncLLM per actor, so concurrent `generate` calls into the actor join
vLLM's continuous batching. Its engine core runs in another process (always,
for AsyncLLM), forked from the actor's forkserver (`engines.vllm.forkserver`);
its GPU workers live there (`uni`, TP=1) or in Ray actors of vLLM's Ray
executor (TP>1) placed on this engine's bundles (see `engines.env.actor_env_vars`).

vLLM itself is imported as the engine starts (`engines.vllm.api`): CPU code
imports this module without it.

This module holds the engine's start and its generation (token ids in,
`RequestOutput`s out, a LoRA adapter pinned per call, the sync's probe); its
control (health, sleep, pause, worker calls) is `engines.vllm.control`'s,
its engine arguments `engines.vllm.args`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

from engines import env
from engines.config import EngineConfig
from engines.errors import RequestError
from engines.load import EngineLoad
from engines.outputs import RequestOutput
from engines.startup import (
    StartupClock,
    actor_clock,
    wait_engines_up,
    wait_turn,
    warn_vocab_mismatch,
)
from engines.vllm import forkserver
from engines.vllm.adapters import lora_request
from engines.vllm.api import padded_vocab_rows, request_output, vllm_api, vllm_sampling_params
from engines.vllm.args import engine_args
from engines.vllm.control import VLLMControl
from engines.vllm.core import CoreCalls
from engines.vllm.load import SchedulerLoad
from engines.vllm.openai_app import openai_app
from engines.vllm.startup_log import OwnLog, vllm_log_phases
from engines.weight_sync.lora.engine import adapter_versions

logger = logging.getLogger(__name__)

#: What vLLM's engine core imports as it starts (v0.26.0, one GPU), imported
#: in the forkserver while the actor imports its own side of vLLM.
ENGINE_CORE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
)


class VLLMEngine(VLLMControl):
    backend = "vllm"

    def __init__(
        self,
        config: EngineConfig,
        clock: StartupClock | None = None,
        after: list[Any] | None = None,
        prepare_only: bool = False,
        environment: dict[str, str] | None = None,
    ):
        """`after`: wait for these before vLLM starts (`wait_turn`).
        `prepare_only`: a prepared actor's start, vLLM's imports and the
        forkserver's and no engine (`engines.lifecycle.prepared`), after
        `after` (`wait_engines_up`). `environment`: the actor's variables
        (`engines.lifecycle.actors.actor_env`)."""
        clock = clock or actor_clock()
        os.environ.update(environment or {})  # before anything reads it (`actor_env`)
        if prepare_only and after:
            wait_engines_up(after, env.ready_timeout_s(), clock)
        if os.environ.get(env.VLLM_ENABLE_V1_MULTIPROCESSING, "1") != "0":  # else no core process
            forkserver.start(ENGINE_CORE_MODULES)
        api = vllm_api()
        clock.mark("vLLM imports")
        if prepare_only:
            self._prepare(config, clock)
            return
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
        forked = forkserver.fork_waits[-1] if forkserver.fork_waits else None
        self.startup = clock.report(
            config.name, self.backend, vllm_log_phases(log.read()), fork_wait_s=forked
        )

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
        app, self._http = openai_app(
            self.config, self.engine, self._admission, lambda: self.check_request([], None)
        )
        return app

    async def load(self) -> EngineLoad:
        return self._load.load(self.engine.output_processor.get_num_unfinished_requests())

    # --- the sync's probe: one request past the door -----------------------------
    def served_quantization(self) -> str | None:
        # The model's, whether asked for (`EngineConfig.quantization`, the
        # engine kwargs) or read from a quantized checkpoint.
        return self.engine.model_config.quantization

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
