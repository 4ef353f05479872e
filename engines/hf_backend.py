"""The CPU backend: a transformers causal LM inside the engine actor.

It serves the same actor API as the vLLM backend, so everything above the
engine layer runs on a laptop or CI box. Concurrent `generate` calls queue up
and a single generation thread runs them in padded batches (static batching:
requests arriving mid-batch wait for the next one).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from engines import env
from engines.base import (
    SLEEP_TAGS,
    RolloutEngine,
    check_sleep_level,
    normalize_prompts,
    wake_tags,
)
from engines.config import EngineConfig
from engines.errors import (
    EngineDeadError,
    EngineTimeoutError,
    RequestError,
)
from engines.hf_sampling import logprob_entry, sample_token
from engines.outputs import CompletionOutput, RequestOutput
from engines.sampling import SamplingParams
from engines.worker_extension import WeightSyncWorkerExtension

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class HFWorker(WeightSyncWorkerExtension):
    """Where the model lives (the counterpart of a vLLM GPU worker)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.rank = 0

    def _model(self) -> torch.nn.Module:
        return self.model


@dataclass
class _Sequence:
    index: int
    generator: torch.Generator
    budget: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative: float = 0.0
    finish_reason: str | None = None


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt_logprobs: list[dict[int, float] | None] | None = None


def sequence_seed(request_seed: int, index: int) -> int:
    return (request_seed * 1_000_003 + index) % (2**63)


class HFEngine(RolloutEngine):
    backend = "hf"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        torch.set_num_threads(env.torch_threads())
        transformers_logging.disable_progress_bar()
        kwargs = dict(config.engine_kwargs)
        dtype = kwargs.pop("dtype", "auto")
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
        self.max_num_seqs = int(kwargs.pop("max_num_seqs", 64))
        trust_remote_code = bool(kwargs.pop("trust_remote_code", False))
        if kwargs:
            logger.info("backend 'hf' ignores vLLM engine arguments %s", sorted(kwargs))

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(
            config.pretrain, trust_remote_code=trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            config.pretrain,
            dtype=DTYPES.get(dtype, "auto"),
            trust_remote_code=trust_remote_code,
        )
        model.to(self.device).eval()
        self.worker = HFWorker(model, self.device)
        # transformers 5.x renamed `past_key_values` to `cache` (the old name
        # warns, and goes in 5.40); older releases only know the old name.
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.vocab_size = model.config.vocab_size
        self.eos_ids = self._eos_ids(model)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0] if self.eos_ids else 0

        # Per-request seeds come from the engine's seed in call order, so a
        # fresh engine with the same seed replays the same tokens.
        self._rng = random.Random(config.seed)
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._running = 0
        self._paused = False
        self._stopping = False
        self._thread_error: BaseException | None = None
        # Held while a batch runs and while weights change: no batch ever sees
        # half-updated weights.
        self._model_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="hf-generate", daemon=True)
        self._thread.start()
        logger.info(
            "engine %s: %s on %s, seed %d", config.name, config.pretrain, self.device, config.seed
        )

    def _eos_ids(self, model: torch.nn.Module) -> list[int]:
        ids = model.generation_config.eos_token_id
        if ids is None:
            ids = self.tokenizer.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        return [int(i) for i in ids]

    # --- API ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def generate(self, prompt_token_ids, sampling_params=None) -> list[RequestOutput]:
        params = SamplingParams.coerce(sampling_params)
        prompts = normalize_prompts(prompt_token_ids)
        self.check_request(prompts, params)
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}"
                )
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        requests = [self._new_request(prompt, params, loop) for prompt in prompts]
        with self._cond:
            self._pending.extend(requests)
            self._cond.notify_all()
        return list(await asyncio.gather(*(r.future for r in requests)))

    async def get_num_unfinished_requests(self) -> int:
        with self._cond:
            return len(self._pending) + self._running

    async def health(self) -> dict[str, Any]:
        self._raise_if_dead()
        info = self.base_health()
        with self._cond:
            info.update(
                num_unfinished_requests=len(self._pending) + self._running,
                paused=self._paused,
                sleeping=sorted(self._asleep),
            )
        info.update(
            device=str(self.device),
            memory=self._memory(),
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        return info

    async def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        # Nothing to offload on the CPU: sleeping means serving no work until
        # woken, like vLLM's sleep mode.
        await self.pause_generation()
        self._asleep = set(SLEEP_TAGS)
        await self.resume_generation()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags_set = wake_tags(tags)
        self._asleep -= tags_set

    async def pause_generation(self) -> None:
        with self._cond:
            self._paused = True
        await asyncio.to_thread(self._wait_idle)

    async def resume_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ):
        function = getattr(self.worker, method, None)
        if function is None or method.startswith("_"):
            raise RequestError(f"the worker has no method {method!r}")

        def run() -> Any:
            with self._model_lock:
                return function(*args, **(kwargs or {}))

        timeout = self.config.rpc_timeout_s if timeout_s is None else timeout_s
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
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # --- generation thread ------------------------------------------------------
    def _new_request(self, prompt: list[int], params: SamplingParams, loop) -> _Request:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        budget = min(params.max_tokens, self.config.max_len - len(prompt))
        sequences = [
            _Sequence(
                index=k,
                generator=torch.Generator().manual_seed(sequence_seed(seed, k)),
                budget=budget,
                logprobs=[] if params.logprobs is not None else None,
            )
            for k in range(params.n)
        ]
        return _Request(uuid.uuid4().hex, prompt, params, sequences, loop, loop.create_future())

    def _wait_idle(self) -> None:
        with self._cond:
            while self._running:
                self._cond.wait()

    def _raise_if_dead(self) -> None:
        if self._thread_error is not None or not self._thread.is_alive():
            raise EngineDeadError(
                f"engine {self.config.name}'s generation thread died: {self._thread_error!r}",
                engine=self.config.name,
            )

    def _take_batch(self) -> list[_Request]:
        batch, seqs = [], 0
        while self._pending:
            if batch and seqs + self._pending[0].params.n > self.max_num_seqs:
                break
            request = self._pending.pop(0)
            batch.append(request)
            seqs += request.params.n
        return batch

    def _serve(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and (not self._pending or self._paused):
                        self._cond.wait()
                    if self._stopping:
                        return
                    batch = self._take_batch()
                    self._running = len(batch)
                try:
                    with self._model_lock, torch.inference_mode():
                        outputs = self._run_batch(batch)
                    for request, output in zip(batch, outputs, strict=True):
                        request.loop.call_soon_threadsafe(_resolve, request.future, output, None)
                except Exception as exc:  # noqa: BLE001 - handed to each caller
                    logger.exception("engine %s: batch failed", self.config.name)
                    for request in batch:
                        request.loop.call_soon_threadsafe(_resolve, request.future, None, exc)
                finally:
                    with self._cond:
                        self._running = 0
                        self._cond.notify_all()
        except BaseException as exc:
            self._thread_error = exc
            raise

    def _run_batch(self, batch: list[_Request]) -> list[RequestOutput]:
        model = self.worker.model
        version = self.weight_version
        rows = [(request, seq) for request in batch for seq in request.sequences]
        width = max(len(request.prompt) for request in batch)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (request, _) in enumerate(rows):
            input_ids[i, width - len(request.prompt) :] = torch.tensor(request.prompt)
            mask[i, width - len(request.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
        )
        self._prompt_logprobs(rows, out.logits, width)
        logits = out.logits[:, -1, :].float().cpu()
        cache = out[self._cache_arg]
        next_position = positions[:, -1:] + 1
        active = [True] * len(rows)
        while True:
            next_tokens = [self.pad_id] * len(rows)
            for i, (request, seq) in enumerate(rows):
                if active[i]:
                    next_tokens[i] = self._step(request.params, seq, logits[i])
                    active[i] = seq.finish_reason is None
            if not any(active):
                break
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            out = model(
                input_ids=torch.tensor(next_tokens).unsqueeze(1).to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=next_position.to(self.device),
                use_cache=True,
                **{self._cache_arg: cache},
            )
            cache = out[self._cache_arg]
            logits = out.logits[:, -1, :].float().cpu()
            next_position = next_position + 1
        return [self._output(request, version) for request in batch]

    def _step(self, params: SamplingParams, seq: _Sequence, logits: torch.Tensor) -> int:
        logprobs = torch.log_softmax(logits, dim=-1)
        too_early = len(seq.token_ids) < params.min_tokens
        banned = self.eos_ids + params.stop_token_ids if too_early else []
        token = sample_token(logits, params, seq.generator, banned=banned)
        seq.token_ids.append(token)
        seq.cumulative += float(logprobs[token])
        if seq.logprobs is not None:
            seq.logprobs.append(logprob_entry(logprobs, token, params.logprobs))
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= seq.budget:
            seq.finish_reason = "length"
        return token

    def _prompt_logprobs(self, rows, logits: torch.Tensor, width: int) -> None:
        for i, (request, seq) in enumerate(rows):
            top = request.params.prompt_logprobs
            if top is None or seq.index != 0:
                continue
            start = width - len(request.prompt)
            # Position t's logits predict token t+1; the first token has none.
            logprobs = torch.log_softmax(logits[i, start:-1].float(), dim=-1).cpu()
            request.prompt_logprobs = [None] + [
                logprob_entry(logprobs[t], token, top) for t, token in enumerate(request.prompt[1:])
            ]

    def _output(self, request: _Request, version: int) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                token_ids=seq.token_ids,
                text=self.tokenizer.decode(seq.token_ids, skip_special_tokens=True),
                finish_reason=seq.finish_reason,
                logprobs=seq.logprobs,
                cumulative_logprob=seq.cumulative,
            )
            for seq in request.sequences
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt,
            outputs=completions,
            weight_version=version,
            engine=self.config.name,
            prompt_logprobs=request.prompt_logprobs,
        )

    def _memory(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {"allocated_bytes": torch.cuda.memory_allocated(self.device)}
        with open("/proc/self/statm") as statm:
            rss_pages = int(statm.read().split()[1])
        return {"rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE")}


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
