"""The project's own sampling parameters, with vLLM's field names."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """Sampling parameters for one request; field names, defaults and meaning
    follow `vllm.SamplingParams`, so the vLLM backend converts them one to one
    and the CPU backend honours every one. A vLLM field not listed here is
    refused by name (extra="forbid").

    Mutable like vLLM's (OpenRLHF's executors set `max_tokens` per turn and
    deep-copy the object); every assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

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

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not text for text in self.stop_strings):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @classmethod
    def coerce(cls, value: Any) -> SamplingParams:
        """Accept our SamplingParams, a dict, None (defaults) or any object with
        vLLM's field names (e.g. `vllm.SamplingParams`)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        fields = {name: getattr(value, name) for name in cls.model_fields if hasattr(value, name)}
        return cls(**fields)
