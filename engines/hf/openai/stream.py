"""`stream: true` on the CPU backend: a finished response sent as vLLM's
server-sent events (chunks, an optional usage chunk, `data: [DONE]`).

The CPU backend generates a request's tokens in one batch and answers when
it ends, so its stream arrives once the generation is done, one chunk per
choice: the same protocol, no earlier first token. Sent after the
generation, the stream's `X-Weight-Versions` header names every version the
request ran under.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from engines.hf.openai import protocol as p


def sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    def events() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def chat_chunks(answer: p.ChatCompletionResponse, include_usage: bool) -> list[dict]:
    head = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created}
    head["model"] = answer.model
    chunks = []
    for choice in answer.choices:
        message = choice.message
        delta: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
        if message.tool_calls:
            delta["tool_calls"] = [
                {"index": i, **call.model_dump()} for i, call in enumerate(message.tool_calls)
            ]
        first = {"index": choice.index, "delta": delta, "logprobs": dump(choice.logprobs)}
        if choice.token_ids is not None:
            first["token_ids"] = choice.token_ids
            first["token_versions"] = choice.token_versions
        last = {
            "index": choice.index,
            "delta": {},
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        chunks += [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if answer.prompt_token_ids is not None:  # vLLM: on the first chunk
        chunks[0]["prompt_token_ids"] = answer.prompt_token_ids
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer.usage.model_dump()})
    return chunks


def completion_chunks(answer: p.CompletionResponse, include_usage: bool) -> list[dict]:
    head = {"id": answer.id, "object": "text_completion", "created": answer.created}
    head["model"] = answer.model
    chunks = [
        {**head, "choices": [choice.model_dump(exclude_none=True) | {"finish_reason": None}]}
        for choice in answer.choices
    ]
    chunks += [
        {**head, "choices": [{"index": c.index, "text": "", "finish_reason": c.finish_reason}]}
        for c in answer.choices
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer.usage.model_dump()})
    return chunks


def dump(model: Any) -> Any:
    return model.model_dump() if model is not None else None
