"""vLLM-shaped OpenAI errors for the CPU backend's routes: every bad request
gets `{"error": {"message", "type", "param", "code"}}` naming the field, and
the engine keeps serving."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from engines.errors import EngineFailure, RequestError
from engines.serving import error_body


class OpenAIError(Exception):
    """A request refused before anything was generated."""

    def __init__(self, message: str, status: int, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def validation_param(errors: list) -> str | None:
    """pydantic's `loc` as vLLM writes `param` ("body.messages.1.role"),
    without union-branch markers such as "str" or "list[int]"."""
    if not errors:
        return None
    parts = [str(p) for p in errors[0].get("loc", ()) if not _internal(str(p))]
    return ".".join(parts) or None


def _internal(segment: str) -> bool:
    return "[" in segment or "(" in segment or segment in ("str", "int", "list", "dict")


def validation_message(errors: list) -> str:
    label = "error" if len(errors) == 1 else "errors"
    lines = [
        f"  {'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')} (input {e.get('input')!r:.80})"
        for e in errors
    ]
    return f"{len(errors)} validation {label}:\n" + "\n".join(lines)


def _json(message: str, status: int, param: str | None = None, kind: str | None = None):
    return JSONResponse(error_body(message, status, param, kind), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def refused(_: Request, exc: OpenAIError):
        kind = "NotFoundError" if exc.status == 404 else "BadRequestError"
        return _json(exc.message, exc.status, exc.param, kind)

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, exc: RequestValidationError):
        errors = list(exc.errors())
        return _json(validation_message(errors), 400, validation_param(errors), "BadRequestError")

    @app.exception_handler(ValidationError)
    async def bad_sampling(_: Request, exc: ValidationError):
        # SamplingParams built from the request: its field is the request's.
        errors = exc.errors()
        return _json(validation_message(errors), 400, validation_param(errors), "BadRequestError")

    @app.exception_handler(RequestError)
    async def engine_refused(_: Request, exc: RequestError):
        return _json(str(exc), 400, None, "BadRequestError")

    @app.exception_handler(EngineFailure)
    async def engine_failed(_: Request, exc: EngineFailure):
        return _json(str(exc), 503, None, "ServiceUnavailableError")
