"""The CPU backend's completions route (`/v1/completions`): prompts as text or
token ids, one or a batch; completion logprobs in the legacy shape.
"""

from __future__ import annotations

from typing import Any

from engines.hf.openai import protocol as p
from engines.hf.openai.errors import OpenAIError
from engines.hf.openai.requests import Served, include_usage, ranked, token_fields, usage
from engines.hf.openai.stream import completion_chunks, sse
from engines.outputs import CompletionOutput


async def serve_completions(served: Served, body: p.CompletionRequest, scope) -> Any:
    served.check_model(body.model)
    for name in ("echo", "suffix"):
        if getattr(body, name):
            raise OpenAIError(f"{name} is not supported by the CPU backend", 400, name)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # vLLM's default
    params = served.params(body, max_tokens, body.logprobs)
    prompts = prompt_ids(served, body)
    outputs = await served.generate(prompts, params, scope)
    choices = []
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            choices.append(
                p.CompletionResponseChoice(
                    index=i * params.n + completion.index,
                    text=completion.text,
                    logprobs=completion_logprobs(completion, body.logprobs),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    **token_fields(completion, output, body.return_token_ids),
                )
            )
    answer = p.CompletionResponse(model=served.model, choices=choices, usage=usage(outputs))
    return sse(completion_chunks(answer, include_usage(body))) if body.stream else answer


def prompt_ids(served: Served, body: p.CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", 400, "prompt")
    ids = []
    for i, one in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt.{i}"
        if isinstance(one, str):
            one = served.engine.tokenizer.encode(one, add_special_tokens=body.add_special_tokens)
        if not one:
            raise OpenAIError(f"{where} is empty", 400, where)
        served.check_ids(one, where)
        served.check_length(one, where)
        ids.append(list(one))
    return ids


def completion_logprobs(completion: CompletionOutput, top: int | None):
    if top is None or completion.logprobs is None:
        return None
    shape, offset = p.CompletionLogProbs(), 0
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        text = position[token].decoded_token or ""
        shape.tokens.append(text)
        shape.token_logprobs.append(position[token].logprob)
        shape.text_offset.append(offset)
        shape.top_logprobs.append(
            {e.decoded_token or "": e.logprob for _, e in ranked(position, top)} or None
        )
        offset += len(text)
    return shape
