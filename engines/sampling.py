"""The project's own sampling parameters, with vLLM's field names."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.errors import RequestError


class SamplingParams(BaseModel):
    """Sampling parameters for one request; field names, defaults and meaning
    follow `vllm.SamplingParams`, so the vLLM backend converts them one to one
    and the CPU backend honours every one. A vLLM field not listed here is
    refused by name.

    Checked as vLLM checks its own: at construction, and when a request uses
    them (`verify`, which the engines call). Assignment is not checked, as on
    vLLM's (any attribute: it is a msgspec Struct with dict=True): OpenRLHF's
    `MultiTurnAgentExecutor` sets `max_tokens = max_length - len(tokens)` and
    reads `<= 0` as "no budget left" before any request is made."""

    # "allow" lets an attribute be assigned; construction and `verify` refuse it.
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    n: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 (or 0) disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_tokens: int | None = Field(16, ge=1, description="None: up to the engine's max_len.")
    min_tokens: int = Field(0, ge=0)
    seed: int | None = Field(None, description="Per-request seed; None uses the engine's.")
    stop: str | list[str] | None = Field(None, description="Strings that end a sample.")
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = Field(
        None, ge=0, description="Top-k logprobs per generated token (0: the sampled one only)."
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, description="Top-k logprobs per prompt token (0: the prompt token only)."
    )

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _no_stop_token_ids(cls, value: Any) -> Any:
        return [] if value is None else value  # vLLM's default is None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, values: Any) -> Any:
        if isinstance(values, dict):
            check_known(values)
        return values

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        self._verify_args()
        return self

    def _verify_args(self) -> None:
        """vLLM's `SamplingParams._verify_args` (vllm/sampling_params.py,
        v0.26.0) for our fields, with its messages; a value of the wrong type
        is named as well (vLLM compares it and fails with a TypeError)."""
        n = self._number("n", int)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= self._number(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        penalty = self._number("repetition_penalty")
        if not math.isfinite(penalty) or penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {penalty}.")
        temperature = self._number("temperature")
        if not math.isfinite(temperature) or temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {temperature}.")
        if not 0.0 < self._number("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self._number("top_k", int) < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self._number("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        max_tokens = self._number("max_tokens", int, optional=True)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        min_tokens = self._number("min_tokens", int)
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = self._number(name, int, optional=True)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}.")
        if self.stop is not None and not isinstance(self.stop, str | list):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not text for text in self.stop_strings):
            raise ValueError("stop cannot contain an empty string.")

    def _number(self, name: str, kind: type = float, optional: bool = False) -> Any:
        value = getattr(self, name)
        if optional and value is None:
            return None
        allowed = int if kind is int else int | float
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ValueError(f"{name} must be {kind.__name__}, got {value!r}.")
        return value

    def verify(self) -> None:
        """Check the values as a request uses them (they may have been
        assigned since construction); raises `RequestError` naming the field,
        and the engine keeps serving."""
        try:
            check_known(self.__pydantic_extra__ or {})
            self._verify_args()
            type(self).model_validate(self.__dict__)  # the types of the rest
        except ValueError as exc:  # pydantic's ValidationError is one
            raise RequestError(describe(exc)) from None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @classmethod
    def coerce(cls, value: Any) -> SamplingParams:
        """Accept our SamplingParams, a dict, None (defaults) or any object with
        vLLM's field names (e.g. `vllm.SamplingParams`), checked for a request
        (`verify`: `RequestError` naming the field)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            value.verify()
            return value
        fields = value if isinstance(value, dict) else _vllm_fields(value, cls.model_fields)
        unchecked = cls.model_construct(**fields)
        unchecked.verify()
        return cls.model_validate(unchecked.__dict__)


def check_known(values: dict[str, Any]) -> None:
    unknown = sorted(set(values) - set(SamplingParams.model_fields))
    if unknown:
        raise ValueError(
            f"unsupported sampling parameters {unknown}: the engines honour "
            f"SamplingParams' fields only ({', '.join(SamplingParams.model_fields)})"
        )


def describe(exc: ValueError) -> str:
    """A check's message: vLLM's (`_verify_args`), or pydantic's naming the field."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    error = exc.errors()[0]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ValueError):
        return str(cause)
    where = ".".join(map(str, error["loc"]))
    return f"{where}={error['input']!r}: {error['msg']}"


def _vllm_fields(value: Any, names: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in names if hasattr(value, name)}
