"""The project's own sampling parameters, with vLLM's field names."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    """Sampling parameters for one request; field names and meaning follow
    `vllm.SamplingParams`, so the vLLM backend converts them one to one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 (or 0) disables top-k.")
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    seed: int | None = Field(None, description="Per-request seed; None uses the engine's.")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(
        None, ge=0, description="Top-k logprobs per generated token (0: the sampled one only)."
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, description="Top-k logprobs per prompt token (0: the prompt token only)."
    )

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

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
        if fields.get("stop_token_ids") is None:
            fields.pop("stop_token_ids", None)
        return cls(**fields)
