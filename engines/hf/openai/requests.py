"""What the CPU backend's OpenAI routes share: the engine as they see it
(`ServedEngine`), the checks every request passes and generation through the
engine (`Served`), and the parts of an answer that chat and completions both
give (usage, token ids and their versions, ranked logprobs).

A bad request gets vLLM's error JSON naming the field (`engines.hf.openai.errors`).
"""

from __future__ import annotations

from typing import Any, Protocol

from engines.config import EngineConfig
from engines.hf.openai import protocol as p
from engines.hf.openai.errors import OpenAIError
from engines.outputs import CompletionOutput, LogprobsPosition, RequestOutput
from engines.sampling import SamplingParams
from engines.serving import record_versions


class ServedEngine(Protocol):
    """What the routes use of the CPU engine (`HFEngine` passes itself):
    generation through its own `_generate`, so pause modes and weight syncs
    hold for HTTP requests as for Ray calls."""

    config: EngineConfig
    tokenizer: Any
    vocab_size: int

    async def _generate(
        self, prompts: list[list[int]], sampling_params: Any
    ) -> list[RequestOutput]: ...


class Served:
    """The engine as its routes serve it: the model's name, the checks every
    request passes, and generation."""

    def __init__(self, engine: ServedEngine, model: str):
        self.engine = engine
        self.model = model

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def check_ids(self, ids: list[int], where: str) -> None:
        vocab = self.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"{where} has token ids outside [0, {vocab}): {bad[:5]}", 400, where)

    def check_length(self, prompt: list[int], where: str) -> None:
        limit = self.engine.config.max_len
        if len(prompt) >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(prompt)} input tokens ({where}), which leaves no room "
                "to generate. Please reduce the length of the input.",
                400,
                where,
            )

    def params(self, body: p.SamplingFields, max_tokens: int | None, logprobs: int | None):
        fields = {
            "n": body.n,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "seed": body.seed,
            "stop": body.stop or None,
            "stop_token_ids": body.stop_token_ids,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
            "min_tokens": body.min_tokens,
            "ignore_eos": body.ignore_eos,
            "skip_special_tokens": body.skip_special_tokens,
            "include_stop_str_in_output": body.include_stop_str_in_output,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
        }
        # None: SamplingParams' (vLLM's) default; a bad value is a 400 naming it.
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    async def generate(self, prompts, params, scope) -> list[RequestOutput]:
        outputs = await self.engine._generate(prompts, params)
        record_versions(scope, sorted({v for o in outputs for v in o.weight_versions}))
        return outputs


def include_usage(body: p.SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def token_fields(completion: CompletionOutput, output: RequestOutput | None, asked) -> dict:
    """vLLM's `return_token_ids` fields, with ours: the version of each token."""
    if not asked:
        return {}
    fields = {"token_ids": completion.token_ids, "token_versions": completion.token_versions}
    if output is not None:  # completions: per choice (chat: at the top)
        fields["prompt_token_ids"] = output.prompt_token_ids
    return fields


def usage(outputs: list[RequestOutput]) -> p.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)  # no prefix cache on CPU: 0
    return p.UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokenUsageInfo(cached_tokens=cached),
    )


def ranked(position: LogprobsPosition, top: int) -> list[tuple[int, Any]]:
    """The `top` most likely entries of a position, most likely first."""
    entries = sorted(position.items(), key=lambda item: item[1].rank or 0)
    return [(token, entry) for token, entry in entries if (entry.rank or 0) <= top]
