"""What every engine of a set is built with (`EngineSettings`, each bound
declared once), and the configuration one engine actor is built from
(`EngineConfig`: plain data, crosses Ray).

The engine-set spec (`engines.lifecycle.spec.EngineSetSpec`) is `EngineSettings` plus
what concerns the set; each engine's config is the same settings plus what
concerns that engine, passed on as a whole (`EngineSettings.settings`). A new
engine knob is one field here, read by the backend.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)

from engines.errors import EngineSpecError


def at_least(least: int) -> BeforeValidator:
    """An integer bound; a bool or a float is refused by name, not coerced."""

    def check(value: Any, info: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise EngineSpecError(f"{info.field_name} must be an integer >= {least}, got {value!r}")
        return value

    return BeforeValidator(check)


def memory_share(value: Any, info: Any) -> Any:
    """A share of each GPU's memory, or None for the backend's default."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1
    ):
        raise EngineSpecError(
            f"{info.field_name} must be in (0, 1] or None (vLLM's default), got {value!r}"
        )
    return value


class Checked(BaseModel):
    """A frozen model whose bad input raises `EngineSpecError` naming the
    value: the error a check raised, or pydantic's for the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            error = exc.errors()[0]
            cause = error.get("ctx", {}).get("error")
            if isinstance(cause, EngineSpecError):
                raise cause from None
            where = ".".join(map(str, error["loc"]))
            if error["type"] == "missing":
                raise EngineSpecError(f"{where} is required") from None
            raise EngineSpecError(f"{where}={error['input']!r}: {error['msg']}") from None


class EngineSettings(Checked):
    """What every engine of a set gets, unchanged."""

    pretrain: str = Field(description="Local model directory (HF layout) or hub id.")
    max_len: Annotated[int, at_least(2)] = Field(
        description="Prompt plus generated tokens, at most."
    )
    gpu_memory_utilization: Annotated[float | None, BeforeValidator(memory_share)] = Field(
        None, description="None: vLLM's default."
    )
    tensor_parallel_size: Annotated[int, at_least(1)] = 1
    enable_prefix_caching: bool = False
    quantization: Literal["fp8"] | None = Field(
        None,
        description="'fp8': vLLM quantizes the bf16 checkpoint, and every weight sync, to FP8 "
        "online (vLLM backend; the CPU backend serves unquantized). None: as the checkpoint.",
    )
    full_determinism: bool = Field(False, description="OpenRLHF's flag (vLLM backend).")
    agent_func_path: str | None = Field(
        None, description="OpenRLHF's agent file, run by `generate_responses` (None: single-turn)."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Backend engine arguments (vLLM's EngineArgs names)."
    )
    openai_api: bool = Field(False, description="Serve the OpenAI API over HTTP (engines.serving).")
    openai_api_key: SecretStr | None = Field(
        None, description="The endpoint's bearer token; generated when openai_api and none given."
    )
    tool_call_parser: str | None = Field(
        None, description="vLLM's: parses `tool_calls` out of chat answers, e.g. 'hermes'."
    )
    enable_lora: bool = Field(
        False, description="Serve LoRA adapters synced by the trainer on the base model."
    )
    max_lora_rank: Annotated[int, at_least(1)] = Field(
        16, description="The largest adapter rank a sync may bring (vLLM sizes its buffers by it)."
    )

    @model_validator(mode="before")
    @classmethod
    def _api_key(cls, data: Any) -> Any:
        # One token per set: the spec draws it, each engine's config copies it.
        if isinstance(data, dict) and data.get("openai_api") and not data.get("openai_api_key"):
            data = {**data, "openai_api_key": secrets.token_urlsafe(32)}
        return data

    @property
    def api_key(self) -> str | None:
        """The bearer token in clear (None when the endpoint is off)."""
        key = self.openai_api_key if self.openai_api else None
        return key.get_secret_value() if key is not None else None

    def settings(self) -> dict[str, Any]:
        """These settings alone, to build an engine's config from a spec."""
        return {name: getattr(self, name) for name in EngineSettings.model_fields}


class EngineConfig(EngineSettings):
    name: str = Field(description="Ray actor name, `<prefix>-<index>`.")
    seed: int
    bundle_indices: list[int] = Field(default_factory=list)
    rpc_timeout_s: float = Field(gt=0.0, description="Deadline of calls into the workers.")
