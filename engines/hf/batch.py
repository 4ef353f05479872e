"""One batch of the CPU backend through the model, on the generation thread
(`engines.hf.loop`): the prompts left-padded into one prefill, then one token
per step with the KV cache, each sequence sampled as vLLM samples
(`engines.hf.sampling`); stop conditions, logprobs and the outputs.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.config import EngineConfig
from engines.hf import sampling
from engines.hf.worker import HFWorker
from engines.outputs import CompletionOutput, LogprobsPosition, RequestOutput
from engines.sampling import SamplingParams


@dataclass
class Sequence:
    index: int
    generator: torch.Generator
    budget: int
    token_ids: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # the version sampling each token
    logprobs: list[LogprobsPosition] | None = None
    cumulative: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # set when a stop string cut it


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    # The weight versions it was generated under (set when its batch starts).
    versions: list[int] = field(default_factory=list)
    prompt_logprobs: list[LogprobsPosition | None] | None = None
    #: With LoRA: the version it was admitted under, whose adapter it runs
    #: on to its end (None: the base model's).
    pinned: int | None = None
    adapter: int | None = None
    #: Its future was answered (as soon as its samples ended, on the generation thread).
    answered: bool = False


def sequence_seed(request_seed: int, index: int) -> int:
    return (request_seed * 1_000_003 + index) % (2**63)


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    ids = model.generation_config.eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return [int(i) for i in ids]


class BatchRunner:
    """Runs batches of requests through the worker's model."""

    def __init__(
        self,
        config: EngineConfig,
        worker: HFWorker,
        tokenizer: Any,
        model_lock: threading.Lock,
        *,
        processed_logprobs: bool,
        version: Callable[[], int],
    ):
        """`model_lock`: held around each forward pass; `version`: the weight
        version served now; `processed_logprobs`: logprobs of the distribution
        sampled from, not the raw one."""
        self.config = config
        self.worker = worker
        self.tokenizer = tokenizer
        model = worker.model
        # transformers 5.x renamed `past_key_values` to `cache` (the old name
        # warns, and goes in 5.40); older releases only know the old name.
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.eos_ids = eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0] if self.eos_ids else 0
        self.processed_logprobs = processed_logprobs
        self._model_lock = model_lock
        self._version = version
        # Per-request seeds come from the engine's seed in call order, so a
        # fresh engine with the same seed replays the same tokens.
        self._rng = random.Random(config.seed)
        # KV cache entries the batch running holds (its padded rows x their
        # width): read by the actor's `load`, from another thread.
        self.held_tokens = 0

    def new_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        loop,
        pinned: tuple[int, int | None] | None = None,
    ) -> Request:
        """`pinned` (LoRA): the version it was admitted under and its adapter."""
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        budget = self.config.max_len - len(prompt)
        if params.max_tokens is not None:  # None: up to max_len, as vLLM
            budget = min(budget, params.max_tokens)
        sequences = [
            Sequence(
                index=k,
                generator=torch.Generator().manual_seed(sequence_seed(seed, k)),
                budget=budget,
                logprobs=[] if params.logprobs is not None else None,
            )
            for k in range(params.n)
        ]
        request = Request(uuid.uuid4().hex, prompt, params, sequences, loop, loop.create_future())
        if pinned is not None:
            request.pinned, request.adapter = pinned
        return request

    def aborted(self, request: Request) -> RequestOutput:
        """The output of a request aborted before its batch ran."""
        request.versions = [self._version()]
        for seq in request.sequences:
            seq.finish_reason = "abort"
        return self._output(request)

    def run(
        self,
        batch: list[Request],
        next_step: Callable[[], bool],
        answer: Callable[[Request, RequestOutput], None],
    ) -> list[RequestOutput]:
        """`next_step()` between two steps: False ends the batch (aborted).
        `answer(request, output)` as soon as a request's samples all ended."""
        try:
            return self._run(batch, next_step, answer)
        finally:
            self.held_tokens = 0

    def _run(
        self,
        batch: list[Request],
        next_step: Callable[[], bool],
        answer: Callable[[Request, RequestOutput], None],
    ) -> list[RequestOutput]:
        rows = [(request, seq) for request in batch for seq in request.sequences]
        version = self._version()
        for request in batch:
            request.versions = [version if request.pinned is None else request.pinned]
        out, mask, next_position = self._prefill(rows)
        self.held_tokens = mask.numel()
        self._prompt_logprobs(rows, out.logits)
        active = [True] * len(rows)
        waiting = list(batch)  # not answered yet
        while True:
            logits = out.logits[:, -1, :].float().cpu()
            next_tokens = [self.pad_id] * len(rows)
            for i, (request, seq) in enumerate(rows):
                if active[i]:
                    next_tokens[i] = self._step(request, seq, logits[i])
                    seq.token_versions.append(version)
                    active[i] = seq.finish_reason is None
            for request in waiting:
                if all(seq.finish_reason is not None for seq in request.sequences):
                    answer(request, self._output(request))
            waiting = [r for r in waiting if any(s.finish_reason is None for s in r.sequences)]
            if not any(active):
                break
            if not next_step():  # aborted (or shutting down)
                for i, (_, seq) in enumerate(rows):
                    if active[i]:
                        seq.finish_reason = "abort"
                break
            # A sync ran while frozen (with LoRA, each request keeps its adapter).
            if not self.config.enable_lora and self._version() != version:
                version = self._version()
                for request in batch:
                    request.versions.append(version)
                out, mask, next_position = self._prefill(rows)
                continue
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            self.held_tokens = mask.numel()
            out = self._forward(
                torch.tensor(next_tokens).unsqueeze(1),
                mask,
                next_position,
                out[self._cache_arg],
                [request.adapter for request, _ in rows],
            )
            next_position = next_position + 1
        return [self._output(request) for request in batch]

    def _forward(self, input_ids, mask, positions, cache=None, adapters=None):
        """`adapters`: per row, the adapter's version (LoRA; None: the base)."""
        device = self.worker.device
        with self._model_lock, torch.inference_mode():
            extra = {} if cache is None else {self._cache_arg: cache}
            store = self.worker.adapters() if self.config.enable_lora else None
            model = self.worker.model
            if store is not None:
                model = functools.partial(store.forward, adapters)
            return model(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                use_cache=True,
                **extra,
            )

    def _prefill(self, rows: list[tuple[Request, Sequence]]):
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
        adapters = [request.adapter for request, _ in rows]
        out = self._forward(input_ids, mask, positions, None, adapters)
        return out, mask, positions[:, -1:] + 1

    def _step(self, request: Request, seq: Sequence, logits: torch.Tensor) -> int:
        params = request.params
        too_early = len(seq.token_ids) < params.min_tokens
        banned = self.eos_ids + params.stop_token_ids if too_early else []
        processed = sampling.processed_logits(
            logits, params, banned=banned, prompt=request.prompt, output=seq.token_ids
        )
        token = sampling.sample_token(processed, params, seq.generator)
        logprobs = torch.log_softmax(processed if self.processed_logprobs else logits, dim=-1)
        seq.token_ids.append(token)
        seq.cumulative += float(logprobs[token])
        if seq.logprobs is not None:
            seq.logprobs.append(
                sampling.logprob_entry(logprobs, token, params.logprobs, self._decode_token)
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

    def _stop_string(self, params: SamplingParams, seq: Sequence) -> bool:
        """As vLLM: the text ends before the stop string (or after it, with
        include_stop_str_in_output); the tokens keep the one that completed it."""
        text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=params.skip_special_tokens)
        found = sampling.find_stop(text, params.stop_strings)
        if found is None:
            return False
        start, stop = found
        seq.text = text[: start + len(stop) if params.include_stop_str_in_output else start]
        seq.stop_reason = stop
        return True

    def _prompt_logprobs(self, rows: list[tuple[Request, Sequence]], logits: torch.Tensor) -> None:
        width = logits.shape[1]
        for i, (request, seq) in enumerate(rows):
            top = request.params.prompt_logprobs
            if top is None or seq.index != 0:
                continue
            start = width - len(request.prompt)
            # Position t's logits predict token t+1; the first token has none.
            logprobs = torch.log_softmax(logits[i, start:-1].float(), dim=-1).cpu()
            request.prompt_logprobs = [None] + [
                sampling.logprob_entry(logprobs[t], token, top, self._decode_token)
                for t, token in enumerate(request.prompt[1:])
            ]

    def _output(self, request: Request) -> RequestOutput:
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
                token_versions=list(seq.token_versions),
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
