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
from engines.errors import (
    EngineDeadError,
    EngineTimeoutError,
    RequestError,
)
from engines.outputs import CompletionOutput, LogprobsPosition, RequestOutput
from engines.sampling import SamplingParams
from engines.spec import check_hf_kwargs
from engines.startup import StartupClock, actor_clock
from engines.worker_extension import WeightSyncWorkerExtension

logger = logging.getLogger(__name__)

# torch, transformers and the sampling helpers (which import torch), imported
# by `import_torch` in the engine actor only: the driver creates the actor
# from this module without paying their import (seconds on a CPU box, on the
# start-up's critical path before the actor even existed).
torch: Any = None
transformers: Any = None
hf_sampling: Any = None


def import_torch() -> None:
    global torch, transformers, hf_sampling  # bound by the imports below
    import torch
    import transformers.utils.logging

    from engines import hf_sampling


def torch_dtype(name: str) -> Any:
    """A dtype name `check_hf_kwargs` accepted, as torch's; "auto" (the
    checkpoint's) as is."""
    aliases = {"float": "float32", "half": "float16"}
    return "auto" if name == "auto" else getattr(torch, aliases.get(name, name))


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
    logprobs: list[LogprobsPosition] | None = None
    cumulative: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # set when a stop string cut it


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    # The weight versions it was generated under (set when its batch starts).
    versions: list[int] = field(default_factory=list)
    prompt_logprobs: list[LogprobsPosition | None] | None = None


def sequence_seed(request_seed: int, index: int) -> int:
    return (request_seed * 1_000_003 + index) % (2**63)


class HFEngine(RolloutEngine):
    backend = "hf"

    def __init__(
        self,
        config: EngineConfig,
        clock: StartupClock | None = None,
        after: list[Any] | None = None,
    ):
        """`after`: wait for these before the model loads (`wait_turn`)."""
        clock = clock or actor_clock()
        import_torch()
        clock.mark("torch and transformers imports")
        super().__init__(config)
        torch.set_num_threads(env.torch_threads())
        transformers.utils.logging.disable_progress_bar()
        kwargs = dict(config.engine_kwargs)
        check_hf_kwargs(kwargs)
        dtype = kwargs.pop("dtype", "auto")
        self.max_num_seqs = int(kwargs.pop("max_num_seqs", 64))
        # vLLM's: logprobs of the raw distribution, or of the one sampled from
        # (after temperature, top-k, top-p); at most `max_logprobs` per token.
        self.processed_logprobs = kwargs.pop("logprobs_mode", "raw_logprobs") != "raw_logprobs"
        self.max_logprobs = int(kwargs.pop("max_logprobs", 20))
        trust_remote_code = bool(kwargs.pop("trust_remote_code", False))
        if kwargs:
            logger.info("backend 'hf' ignores vLLM engine arguments %s", sorted(kwargs))

        if after:
            wait_turn(after, env.ready_timeout_s(), config.name, clock)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(
            config.pretrain, trust_remote_code=trust_remote_code
        )
        clock.mark("tokenizer")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            config.pretrain,
            dtype=torch_dtype(dtype),
            trust_remote_code=trust_remote_code,
        )
        model.to(self.device).eval()
        clock.mark("model load")
        self.worker = HFWorker(model, self.device)
        # transformers 5.x renamed `past_key_values` to `cache` (the old name
        # warns, and goes in 5.40); older releases only know the old name.
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.vocab_size = model.config.vocab_size
        warn_vocab_mismatch(
            config.name,
            len(self.tokenizer),
            self.vocab_size,
            model.get_input_embeddings().weight.shape[0],
        )
        self.eos_ids = self._eos_ids(model)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0] if self.eos_ids else 0

        # Per-request seeds come from the engine's seed in call order, so a
        # fresh engine with the same seed replays the same tokens.
        self._rng = random.Random(config.seed)
        # Shared with the generation thread, under `_cond`: the queue, the
        # batch running, and the pause flags it obeys between two steps.
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._running = 0
        self._stepping = False  # the thread is inside a step (a forward pass and sampling)
        self._frozen = False  # pause "keep": park before the next step
        self._aborting = False  # pause "abort": end the batch running
        self._stopping = False
        self._thread_error: BaseException | None = None
        self._ended = False  # the thread is gone: nothing queued would run
        # Held around each forward pass and while the workers run an RPC
        # (weights change): no step ever sees half-updated weights.
        self._model_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="hf-generate", daemon=True)
        self._thread.start()
        clock.mark("generation thread")
        self.startup = clock.report(config.name, self.backend)
        logger.info(
            "engine %s: %s on %s, seed %d, up in %.1fs",
            config.name,
            config.pretrain,
            self.device,
            config.seed,
            self.startup.seconds,
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
            self._raise_if_dead()
            loop = asyncio.get_running_loop()
            requests = [self._new_request(prompt, params, loop) for prompt in prompts]
            with self._cond:
                if self._ended:  # since `_raise_if_dead`: nothing would run them
                    raise self._dead_error()
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
                paused=self._admission.closed,
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
        # woken, like vLLM's sleep mode (which lets requests in flight finish).
        await self.pause_generation(mode="wait")
        self._asleep = set(SLEEP_TAGS)
        await self.resume_generation()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags_set = wake_tags(tags)
        self._asleep -= tags_set

    async def _freeze(self) -> None:
        def park() -> None:
            with self._cond:
                self._frozen = True
                while self._stepping:
                    self._cond.wait()

        await asyncio.to_thread(park)

    async def _thaw(self) -> None:
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    async def _abort_requests(self) -> None:
        with self._cond:
            queued, self._pending = self._pending, []
            self._aborting = bool(self._running)
            self._cond.notify_all()
        for request in queued:
            request.versions = [self.weight_version]
            for seq in request.sequences:
                seq.finish_reason = "abort"
            _resolve(request.future, self._output(request), None)

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
        budget = self.config.max_len - len(prompt)
        if params.max_tokens is not None:  # None: up to max_len, as vLLM
            budget = min(budget, params.max_tokens)
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

    def _raise_if_dead(self) -> None:
        if self._ended or not self._thread.is_alive():
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        cause = "" if self._thread_error is None else f": {self._thread_error!r}"
        return EngineDeadError(
            f"engine {self.config.name}'s generation thread ended{cause}", engine=self.config.name
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
                    while not self._stopping and (not self._pending or self._frozen):
                        self._cond.wait()
                    if self._stopping:
                        return
                    batch = self._take_batch()
                    self._running = len(batch)
                    self._stepping = True
                try:
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
                        self._stepping = self._aborting = False
                        self._cond.notify_all()
        except BaseException as exc:
            self._thread_error = exc
            raise
        finally:
            self._fail_queued()

    def _fail_queued(self) -> None:
        """The generation thread is ending: nothing will run what is queued,
        so its callers learn now that the engine is dead, not at their deadline."""
        with self._cond:
            self._ended = True
            queued, self._pending = self._pending, []
        for request in queued:
            request.loop.call_soon_threadsafe(_resolve, request.future, None, self._dead_error())

    def _next_step(self) -> bool:
        """Between two steps: park while frozen; False when the batch is aborted."""
        with self._cond:
            self._stepping = False
            self._cond.notify_all()
            while self._frozen and not (self._stopping or self._aborting):
                self._cond.wait()
            self._stepping = True
            return not (self._stopping or self._aborting)

    def _forward(self, input_ids, mask, positions, cache=None):
        with self._model_lock, torch.inference_mode():
            extra = {} if cache is None else {self._cache_arg: cache}
            return self.worker.model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                **extra,
            )

    def _prefill(self, rows: list[tuple[_Request, _Sequence]]):
        """A forward pass over each row's prompt and tokens so far, left-padded:
        the first step, and the first after a sync under frozen requests (their
        KV cache is recomputed with the new weights, as vLLM does)."""
        tokens = [request.prompt + seq.token_ids for request, seq in rows]
        width = max(len(t) for t in tokens)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(tokens):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return self._forward(input_ids, mask, positions), mask, positions[:, -1:] + 1

    def _run_batch(self, batch: list[_Request]) -> list[RequestOutput]:
        rows = [(request, seq) for request in batch for seq in request.sequences]
        version = self.weight_version
        for request in batch:
            request.versions = [version]
        out, mask, next_position = self._prefill(rows)
        self._prompt_logprobs(rows, out.logits)
        active = [True] * len(rows)
        while True:
            logits = out.logits[:, -1, :].float().cpu()
            next_tokens = [self.pad_id] * len(rows)
            for i, (request, seq) in enumerate(rows):
                if active[i]:
                    next_tokens[i] = self._step(request, seq, logits[i])
                    active[i] = seq.finish_reason is None
            if not any(active):
                break
            if not self._next_step():  # aborted (or shutting down)
                for i, (_, seq) in enumerate(rows):
                    if active[i]:
                        seq.finish_reason = "abort"
                break
            if self.weight_version != version:  # a sync ran while frozen
                version = self.weight_version
                for request in batch:
                    request.versions.append(version)
                out, mask, next_position = self._prefill(rows)
                continue
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            out = self._forward(
                torch.tensor(next_tokens).unsqueeze(1),
                mask,
                next_position,
                out[self._cache_arg],
            )
            next_position = next_position + 1
        return [self._output(request) for request in batch]

    def _step(self, request: _Request, seq: _Sequence, logits: torch.Tensor) -> int:
        params = request.params
        too_early = len(seq.token_ids) < params.min_tokens
        banned = self.eos_ids + params.stop_token_ids if too_early else []
        processed = hf_sampling.processed_logits(
            logits, params, banned=banned, prompt=request.prompt, output=seq.token_ids
        )
        token = hf_sampling.sample_token(processed, params, seq.generator)
        logprobs = torch.log_softmax(processed if self.processed_logprobs else logits, dim=-1)
        seq.token_ids.append(token)
        seq.cumulative += float(logprobs[token])
        if seq.logprobs is not None:
            seq.logprobs.append(
                hf_sampling.logprob_entry(logprobs, token, params.logprobs, self._decode_token)
            )
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token  # as vLLM reports it
        elif token in self.eos_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif params.stop and not too_early and self._stop_string(params, seq):
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= seq.budget:
            seq.finish_reason = "length"
        return token

    def _stop_string(self, params: SamplingParams, seq: _Sequence) -> bool:
        """As vLLM: the text ends before the stop string (or after it, with
        include_stop_str_in_output); the tokens keep the one that completed it."""
        text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=params.skip_special_tokens)
        found = hf_sampling.find_stop(text, params.stop_strings)
        if found is None:
            return False
        start, stop = found
        seq.text = text[: start + len(stop) if params.include_stop_str_in_output else start]
        seq.stop_reason = stop
        return True

    def _prompt_logprobs(self, rows, logits: torch.Tensor) -> None:
        width = logits.shape[1]
        for i, (request, seq) in enumerate(rows):
            top = request.params.prompt_logprobs
            if top is None or seq.index != 0:
                continue
            start = width - len(request.prompt)
            # Position t's logits predict token t+1; the first token has none.
            logprobs = torch.log_softmax(logits[i, start:-1].float(), dim=-1).cpu()
            request.prompt_logprobs = [None] + [
                hf_sampling.logprob_entry(logprobs[t], token, top, self._decode_token)
                for t, token in enumerate(request.prompt[1:])
            ]

    def _output(self, request: _Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                token_ids=seq.token_ids,
                text=seq.text
                if seq.text is not None
                else self.tokenizer.decode(
                    seq.token_ids, skip_special_tokens=request.params.skip_special_tokens
                ),
                finish_reason=seq.finish_reason,
                logprobs=seq.logprobs,
                cumulative_logprob=seq.cumulative,
                stop_reason=seq.stop_reason,
            )
            for seq in request.sequences
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt,
            outputs=completions,
            weight_version=request.versions[0],
            weight_versions=list(request.versions),
            engine=self.config.name,
            prompt_logprobs=request.prompt_logprobs,
        )

    def _decode_token(self, token: int) -> str:
        return self.tokenizer.decode([token])

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
