"""The CPU backend: a transformers causal LM inside the engine actor.

It serves the same actor API as the vLLM backend, so everything above the
engine layer runs on a laptop or CI box. Concurrent `generate` calls queue up
and one generation thread (`engines.hf.loop`) runs them in padded batches
(`engines.hf.batch`; static batching: requests arriving mid-batch wait for
the next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import ray

from engines import env
from engines.base import RolloutEngine
from engines.config import EngineConfig
from engines.control import SLEEP_TAGS, check_sleep_level, wake_tags
from engines.errors import EngineTimeoutError, RequestError
from engines.hf.loop import GenerationLoop
from engines.hf.openai.tool_parsers import check_tool_call_parser
from engines.hf.options import HFOptions, check_hf_kwargs
from engines.load import EngineLoad
from engines.outputs import RequestOutput
from engines.sampling import SamplingParams
from engines.startup import (
    StartupClock,
    actor_clock,
    wait_engines_up,
    wait_turn,
    warn_vocab_mismatch,
)
from engines.weight_sync.lora.engine import adapter_versions
from engines.weight_sync.probe import sequence_logprobs

logger = logging.getLogger(__name__)


class HFEngine(RolloutEngine):
    backend = "hf"

    @classmethod
    def check_settings(cls, engine_kwargs: dict[str, Any], tool_call_parser: str | None) -> None:
        check_hf_kwargs(engine_kwargs)
        check_tool_call_parser(tool_call_parser)

    def __init__(
        self,
        config: EngineConfig,
        clock: StartupClock | None = None,
        after: list[Any] | None = None,
        prepare_only: bool = False,
        environment: dict[str, str] | None = None,
    ):
        """`after`: wait for these before the model loads (`wait_turn`).
        `prepare_only`: a prepared actor's start, the imports and no engine
        (`engines.lifecycle.prepared`), after `after` (`wait_engines_up`).
        `environment`: the actor's variables
        (`engines.lifecycle.actors.actor_env`)."""
        clock = clock or actor_clock()
        os.environ.update(environment or {})  # before anything reads it (`actor_env`)
        if prepare_only and after:
            wait_engines_up(after, env.ready_timeout_s(), clock)
        # torch and transformers come with these, imported in the engine actor
        # only: the driver creates the actor from this module without paying
        # their import (seconds on a CPU box, on the start-up's critical path
        # before the actor even existed).
        from engines.hf.batch import BatchRunner
        from engines.hf.worker import load_model

        clock.mark("torch and transformers imports")
        if prepare_only:
            self._prepare(config, clock)
            return
        super().__init__(config)
        options = HFOptions.from_engine_kwargs(config.engine_kwargs)
        self.max_logprobs = options.max_logprobs
        if after:
            wait_turn(after, env.ready_timeout_s(), config.name, clock)
        self.tokenizer, self.worker = load_model(
            config.pretrain, options.dtype, options.trust_remote_code, clock
        )
        model = self.worker.model
        self.vocab_size = model.config.vocab_size
        warn_vocab_mismatch(
            config.name,
            len(self.tokenizer),
            self.vocab_size,
            model.get_input_embeddings().weight.shape[0],
        )
        # Held around each forward pass and while the workers run an RPC
        # (weights change): no step ever sees half-updated weights.
        self._model_lock = threading.Lock()
        self._runner = BatchRunner(
            config,
            self.worker,
            self.tokenizer,
            self._model_lock,
            processed_logprobs=options.processed_logprobs,
            version=lambda: self.weight_version,
        )
        self._loop = GenerationLoop(config.name, options.max_num_seqs, self._runner.run)
        # No prefix cache: every prompt token of every sequence is computed,
        # a lookup that never hits (`EngineLoad.prefix_cache_queries`).
        self._prompt_tokens = 0
        clock.mark("generation thread")
        self.startup = clock.report(config.name, self.backend)
        logger.info(
            "engine %s: %s on %s, seed %d, up in %.1fs",
            config.name,
            config.pretrain,
            self.worker.device,
            config.seed,
            self.startup.seconds,
        )

    # --- API ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _generate(self, prompts, sampling_params) -> list[RequestOutput]:
        params = SamplingParams.coerce(sampling_params)
        self.check_request(prompts, params)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise RequestError(
                    f"{name}={asked} is more than the engine's max_logprobs={self.max_logprobs}"
                )
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}"
                )
        # Waits while paused. The generation thread itself records the versions
        # each request runs under (a queued one may wait through a sync).
        async with self._admission.request():
            self.check_request(prompts, params)  # a failed sync may have left it stale
            self._loop.raise_if_dead()
            loop = asyncio.get_running_loop()
            with self._pinned() as pinned:
                requests = [
                    self._runner.new_request(prompt, params, loop, pinned) for prompt in prompts
                ]
                self._prompt_tokens += params.n * sum(len(prompt) for prompt in prompts)
                self._loop.submit(requests)
                return list(await asyncio.gather(*(r.future for r in requests)))

    @contextlib.contextmanager
    def _pinned(self) -> Iterator[tuple[int, int | None] | None]:
        """With LoRA: the version served now and its adapter, which the call's
        requests run on to their end (held so the adapter is not removed)."""
        if not self.config.enable_lora:
            yield None
            return
        version = self.weight_version
        with adapter_versions(self.weights).pinned(version) as adapter:
            yield version, adapter

    async def get_num_unfinished_requests(self) -> int:
        return self._loop.unfinished()

    async def load(self) -> EngineLoad:
        running, waiting = self._loop.sequences()
        # No paged cache here: the batch holds its padded rows' keys and
        # values, out of the most it can hold (max_num_seqs rows of max_len).
        capacity = self._loop.max_num_seqs * self.config.max_len
        usage = min(1.0, self._runner.held_tokens / capacity)
        return EngineLoad(running, waiting, usage, prefix_cache_queries=self._prompt_tokens)

    async def health(self) -> dict[str, Any]:
        self._loop.raise_if_dead()
        info = self.base_health()
        info.update(
            num_unfinished_requests=self._loop.unfinished(),
            paused=self._admission.closed,
            sleeping=sorted(self._asleep),
            device=str(self.worker.device),
            memory=self._memory(),
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        return info

    async def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        # Nothing to offload on the CPU: sleeping means serving no work until
        # woken, like vLLM's sleep mode (which lets requests in flight finish).
        await self.pause_generation(mode="wait")
        self._asleep = set(SLEEP_TAGS)
        await self.resume_generation()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags_set = wake_tags(tags)
        self._asleep -= tags_set

    async def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        def run() -> list[float]:
            with self._model_lock:
                return sequence_logprobs(self.worker.model, token_ids)

        # On the generation thread, ahead of its next step: one forward pass
        # between two of the first batch's steps, not after the whole batch.
        job = asyncio.wrap_future(self._loop.run_between_steps(run))
        return await asyncio.wait_for(job, self.config.rpc_timeout_s)

    async def _freeze(self) -> None:
        await asyncio.to_thread(self._loop.freeze)

    async def _thaw(self) -> None:
        self._loop.thaw()

    async def _abort_requests(self) -> None:
        self._loop.abort(self._runner.aborted)

    async def _rpc(self, method: Any, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        function = getattr(self.worker, method, None)
        if function is None:
            raise RequestError(f"the worker has no method {method!r}")

        def run() -> Any:
            with self._model_lock:
                return function(*args, **kwargs)

        try:
            # The thread itself cannot be interrupted: the worker's own
            # collectives carry deadlines; this bounds what the caller waits.
            return [await asyncio.wait_for(asyncio.to_thread(run), timeout)]
        except TimeoutError as exc:
            raise EngineTimeoutError(
                f"engine {self.config.name}: {method} took longer than {timeout:g}s",
                engine=self.config.name,
            ) from exc

    async def shutdown(self) -> None:
        # The generation first: requests in flight end (aborted) and are
        # answered, so the server's graceful stop need not wait them out.
        if self.prepared:  # no engine yet
            return
        self._loop.stop()
        await self._stop_openai()

    def _openai_app(self) -> Any:
        from engines.hf.openai.app import build_app

        return build_app(self)

    def _memory(self) -> dict[str, int]:
        device = self.worker.device
        if device.type == "cuda":
            import torch  # imported with the model already (see __init__)

            return {"allocated_bytes": torch.cuda.memory_allocated(device)}
        with open("/proc/self/statm") as statm:
            rss_pages = int(statm.read().split()[1])
        return {"rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE")}
