"""The CPU backend's OpenAI app (`HFEngine._openai_app`): vLLM's request and
response shapes (`engines.hf.openai.protocol`) on the engine's routes: chat
(`engines.hf.openai.chat`), completions (`engines.hf.openai.completions`),
and here the model list, tokenize and detokenize. Auth and version headers
are `engines.serving`'s.

Every request is checked before anything is generated (`engines.hf.openai.requests`);
a bad one gets vLLM's error JSON naming the field (`engines.hf.openai.errors`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from engines.hf.openai import protocol as p
from engines.hf.openai.chat import render, serve_chat
from engines.hf.openai.completions import serve_completions
from engines.hf.openai.errors import install_error_handlers
from engines.hf.openai.requests import Served, ServedEngine


def build_app(engine: ServedEngine) -> FastAPI:
    app = FastAPI(title=f"rolloutflow engine {engine.config.name}", openapi_url=None)
    install_error_handlers(app)
    model = engine.config.pretrain
    served = Served(engine, model)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        card = p.ModelCard(id=model, root=model, max_model_len=engine.config.max_len)
        return p.ModelList(data=[card])

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        """A ChatCompletionResponse, or its stream (`engines.hf.openai.stream`)."""
        return await serve_chat(served, body, request.scope)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        """A CompletionResponse, or its stream."""
        return await serve_completions(served, body, request.scope)

    @app.post("/tokenize")
    async def tokenize(
        body: p.TokenizeCompletionRequest | p.TokenizeChatRequest,
    ) -> p.TokenizeResponse:
        served.check_model(body.model)
        if isinstance(body, p.TokenizeChatRequest):
            tokens = render(served, body, body.tools)
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
        served.check_model(body.model)
        served.check_ids(body.tokens, "tokens")
        return p.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    return app
