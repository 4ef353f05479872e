"""The CPU backend's OpenAI routes (`HFEngine._openai_app`): vLLM's request and
response shapes (`engines.hf.openai.protocol`), generation through the
engine's own `_generate`, so pause modes and weight syncs hold for HTTP
requests as for Ray calls. Auth and version headers are `engines.serving`'s.

Every request is checked before anything is generated; a bad one gets vLLM's
error JSON naming the field (`engines.hf.openai.errors`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from engines.hf.openai import protocol as p
from engines.hf.openai.errors import OpenAIError, install_error_handlers
from engines.hf.openai.stream import chat_chunks, completion_chunks, sse
from engines.hf.openai.tool_parsers import TOOL_PARSERS, ParsedAnswer, ParsedCall
from engines.outputs import CompletionOutput, LogprobsPosition, RequestOutput
from engines.sampling import SamplingParams
from engines.serving import record_versions

if TYPE_CHECKING:
    from engines.hf.engine import HFEngine


def build_app(engine: HFEngine) -> FastAPI:
    app = FastAPI(title=f"rolloutflow engine {engine.config.name}", openapi_url=None)
    install_error_handlers(app)
    served = engine.config.pretrain
    routes = Routes(engine, served)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        card = p.ModelCard(id=served, root=served, max_model_len=engine.config.max_len)
        return p.ModelList(data=[card])

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        """A ChatCompletionResponse, or its stream (`engines.hf.openai.stream`)."""
        return await routes.chat(body, request.scope)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        """A CompletionResponse, or its stream."""
        return await routes.completions(body, request.scope)

    @app.post("/tokenize")
    async def tokenize(
        body: p.TokenizeCompletionRequest | p.TokenizeChatRequest,
    ) -> p.TokenizeResponse:
        routes.check_model(body.model)
        if isinstance(body, p.TokenizeChatRequest):
            tokens = routes.render(body, body.tools)
        else:
            tokens = engine.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        strs = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return p.TokenizeResponse(
            count=len(tokens), max_model_len=engine.config.max_len, tokens=tokens, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        routes.check_model(body.model)
        routes.check_ids(body.tokens, "tokens")
        return p.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    return app


class Routes:
    """The generating routes and the checks they share."""

    def __init__(self, engine: HFEngine, served: str):
        self.engine = engine
        self.served = served

    # --- checks -------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served:
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

    def render(self, body: p.ChatCompletionRequest | p.TokenizeChatRequest, tools) -> list[int]:
        """The chat template's prompt ids (tools passed to the template)."""
        messages = [chat_message(m) for m in body.messages]
        try:
            text = self.engine.tokenizer.apply_chat_template(
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
        return self.engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

    # --- routes -------------------------------------------------------------------
    async def chat(self, body: p.ChatCompletionRequest, scope) -> Any:
        self.check_model(body.model)
        choice, parser = self.tool_choice(body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = self.params(body, body.max_completion_tokens or body.max_tokens, top)
        prompt = self.render(body, body.tools)
        self.check_length(prompt, "messages")
        output = (await self.generate([prompt], params, scope))[0]
        choices = [
            chat_choice(completion, choice, parser, top, body.return_token_ids)
            for completion in output.outputs
        ]
        answer = p.ChatCompletionResponse(
            model=self.served,
            choices=choices,
            usage=usage([output]),
            prompt_token_ids=prompt if body.return_token_ids else None,
        )
        return sse(chat_chunks(answer, include_usage(body))) if body.stream else answer

    async def completions(self, body: p.CompletionRequest, scope) -> Any:
        self.check_model(body.model)
        for name in ("echo", "suffix"):
            if getattr(body, name):
                raise OpenAIError(f"{name} is not supported by the CPU backend", 400, name)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # vLLM's default
        params = self.params(body, max_tokens, body.logprobs)
        prompts = self.prompts(body)
        outputs = await self.generate(prompts, params, scope)
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
        answer = p.CompletionResponse(model=self.served, choices=choices, usage=usage(outputs))
        return sse(completion_chunks(answer, include_usage(body))) if body.stream else answer

    def prompts(self, body: p.CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be empty", 400, "prompt")
        ids = []
        for i, one in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt.{i}"
            if isinstance(one, str):
                one = self.engine.tokenizer.encode(one, add_special_tokens=body.add_special_tokens)
            if not one:
                raise OpenAIError(f"{where} is empty", 400, where)
            self.check_ids(one, where)
            self.check_length(one, where)
            ids.append(list(one))
        return ids

    async def generate(self, prompts, params, scope) -> list[RequestOutput]:
        outputs = await self.engine._generate(prompts, params)
        record_versions(scope, sorted({v for o in outputs for v in o.weight_versions}))
        return outputs

    # --- tools --------------------------------------------------------------------
    def tool_choice(self, body: p.ChatCompletionRequest) -> tuple[Any, Any]:
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
        name = self.engine.config.tool_call_parser
        if choice == "auto" and name is None:
            raise OpenAIError(
                'tool_choice "auto" needs the engine setting tool_call_parser (e.g. "hermes")',
                400,
                "tool_choice",
            )
        return choice, TOOL_PARSERS.get(name) if name else None


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


def include_usage(body: p.SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def required_calls(text: str, parser) -> ParsedAnswer:
    """tool_choice "required": vLLM's format (a JSON list of {name, parameters},
    which vLLM's guided decoding forces; this backend does not constrain
    decoding), else the engine's parser."""
    try:
        calls = [
            ParsedCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in json.loads(text)
        ]
    except (json.JSONDecodeError, KeyError, TypeError):
        return parser(text) if parser is not None else ParsedAnswer(text)
    return ParsedAnswer(None, calls)


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
