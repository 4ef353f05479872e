"""The CPU backend's chat route (`/v1/chat/completions`): the messages
rendered by the model's chat template, the answer's tool calls parsed as
`tool_choice` asks (`engines.hf.openai.tool_parsers`), chat logprobs.
"""

from __future__ import annotations

import json
from typing import Any

from engines.hf.openai import protocol as p
from engines.hf.openai.errors import OpenAIError
from engines.hf.openai.requests import Served, include_usage, ranked, token_fields, usage
from engines.hf.openai.stream import chat_chunks, sse
from engines.hf.openai.tool_parsers import TOOL_PARSERS, ParsedAnswer, ParsedCall
from engines.outputs import CompletionOutput


async def serve_chat(served: Served, body: p.ChatCompletionRequest, scope) -> Any:
    served.check_model(body.model)
    choice, parser = tool_choice(served, body)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = served.params(body, body.max_completion_tokens or body.max_tokens, top)
    prompt = render(served, body, body.tools)
    served.check_length(prompt, "messages")
    output = (await served.generate([prompt], params, scope))[0]
    choices = [
        chat_choice(completion, choice, parser, top, body.return_token_ids)
        for completion in output.outputs
    ]
    answer = p.ChatCompletionResponse(
        model=served.model,
        choices=choices,
        usage=usage([output]),
        prompt_token_ids=prompt if body.return_token_ids else None,
    )
    return sse(chat_chunks(answer, include_usage(body))) if body.stream else answer


def tool_choice(served: Served, body: p.ChatCompletionRequest) -> tuple[Any, Any]:
    """(the tool choice, the parser for "auto"), checked against `tools`."""
    choice = body.tool_choice
    if choice is None:  # vLLM: "auto" when tools are given, else "none"
        choice = "auto" if body.tools else "none"
    names = [t.function.name for t in body.tools or []]
    if isinstance(choice, p.ChatCompletionNamedToolChoiceParam):
        if choice.function.name not in names:
            raise OpenAIError(
                f"tool_choice names the tool {choice.function.name!r}, which is not in "
                f"`tools` ({names})",
                400,
                "tool_choice",
            )
        return choice, None
    if choice in ("auto", "required") and not names:
        raise OpenAIError(f'tool_choice "{choice}" needs `tools`', 400, "tool_choice")
    name = served.engine.config.tool_call_parser
    if choice == "auto" and name is None:
        raise OpenAIError(
            'tool_choice "auto" needs the engine setting tool_call_parser (e.g. "hermes")',
            400,
            "tool_choice",
        )
    return choice, TOOL_PARSERS.get(name) if name else None


def render(
    served: Served, body: p.ChatCompletionRequest | p.TokenizeChatRequest, tools
) -> list[int]:
    """The chat template's prompt ids (tools passed to the template)."""
    messages = [chat_message(m) for m in body.messages]
    try:
        text = served.engine.tokenizer.apply_chat_template(
            messages,
            tools=[t.function.model_dump(exclude_none=True) for t in tools] if tools else None,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=False,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - the template's own error, for the caller
        raise OpenAIError(
            f"the chat template failed on these messages: {exc}", 400, "messages"
        ) from exc
    return served.engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)


def chat_choice(completion: CompletionOutput, choice, parser, top, return_ids):
    """One chat choice: the answer's tool calls parsed as `choice` asks."""
    text, finish = completion.text, completion.finish_reason
    if isinstance(choice, p.ChatCompletionNamedToolChoiceParam):
        # As vLLM: the answer is the named function's arguments.
        answer = ParsedAnswer(None, [ParsedCall(choice.function.name, text)])
    elif choice == "required":
        answer = required_calls(text, parser)
    elif choice == "auto" and parser is not None:
        answer = parser(text)
    else:
        answer = ParsedAnswer(text)
    if answer.calls and choice in ("auto", "required"):  # as vLLM; a named choice: "stop"
        finish = "tool_calls"
    message = p.ChatMessage(
        role="assistant",
        content=answer.content,
        tool_calls=[
            p.ToolCall(function=p.FunctionCall(name=c.name, arguments=c.arguments))
            for c in answer.calls
        ],
    )
    return p.ChatCompletionResponseChoice(
        index=completion.index,
        message=message,
        logprobs=chat_logprobs(completion, top),
        finish_reason=finish,
        stop_reason=completion.stop_reason,
        **token_fields(completion, None, return_ids),
    )


def required_calls(text: str, parser) -> ParsedAnswer:
    """tool_choice "required": vLLM's format first (a JSON list of one or more
    {name, parameters}: vLLM's guided decoding forces that schema, minItems 1,
    so its answer always holds a call), else the engine's parser. This backend
    does not constrain decoding: an answer with no call in either form (`{}`,
    `[]`, prose) is returned as its text, as "auto" returns an answer without
    calls; dropping it would leave the caller nothing."""
    calls = _listed_calls(text)
    if calls:
        return ParsedAnswer(None, calls)
    return parser(text) if parser is not None else ParsedAnswer(text)


def _listed_calls(text: str) -> list[ParsedCall]:
    """The calls of vLLM's "required" schema (`[{"name": ..., "parameters":
    {...}}, ...]`); none when `text` is not that."""
    try:
        listed = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(listed, list) or not all(
        isinstance(c, dict)
        and isinstance(c.get("name"), str)
        and isinstance(c.get("parameters", {}), dict | None)
        for c in listed
    ):
        return []
    return [
        ParsedCall(c["name"], json.dumps(c.get("parameters") or {}, ensure_ascii=False))
        for c in listed
    ]


def chat_message(message: p.ChatMessageParam) -> dict[str, Any]:
    """A message as chat templates take it: text content joined, None fields left out."""
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        data["content"] = "".join(part.text for part in message.content)
    for call in data.get("tool_calls", []):
        # As vLLM (entrypoints/chat_utils.py): templates render arguments as
        # an object (`| tojson`), so the JSON text goes back to one.
        function = call.get("function", {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError as exc:
                raise OpenAIError(
                    f"a tool call's arguments are not JSON: {exc}", 400, "messages"
                ) from exc
    return data


def chat_logprobs(completion: CompletionOutput, top: int | None):
    if top is None or completion.logprobs is None:
        return None
    content = []
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        entry = position[token]
        content.append(
            p.ChatCompletionLogProbsContent(
                token=entry.decoded_token or "",
                logprob=max(entry.logprob, -9999.0),
                bytes=list((entry.decoded_token or "").encode()),
                top_logprobs=[
                    p.ChatCompletionLogProb(
                        token=e.decoded_token or "",
                        logprob=max(e.logprob, -9999.0),
                        bytes=list((e.decoded_token or "").encode()),
                    )
                    for _, e in ranked(position, top)
                ],
            )
        )
    return p.ChatCompletionLogProbs(content=content)
