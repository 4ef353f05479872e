"""A run's sampling section: the fields and bounds of the engines'
`SamplingParams` (declared there, once), with the run's defaults and the
run form's wording, and the run's base seed; `request()` makes the
sampling every request of the run shares."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from engines.sampling import SamplingParams
from tasks.run.params import SECTION


def sampled(name: str, default: Any = PydanticUndefined, **run: Any) -> Any:
    """`SamplingParams`' declaration of field `name` (its bounds live there,
    once), with the run's own default where given, and `run`: the form's
    wording."""
    if default is not PydanticUndefined:
        run["default"] = default
    return FieldInfo.merge_field_infos(SamplingParams.model_fields[name], Field(**run))


class SamplingSection(BaseModel):
    """A run's sampling: `SamplingParams`' fields and bounds (`request()`
    makes the request's), with the run's defaults, and the run's base seed."""

    model_config = SECTION

    n: int = sampled("n", title="Samples per prompt")
    temperature: float = sampled(
        "temperature", description="0 means greedy. The default of --agent sessions' requests."
    )
    top_p: float = sampled("top_p")
    top_k: int = sampled("top_k")
    max_tokens: int = sampled(
        "max_tokens", 64, description="Response tokens at most; --agent sessions' default too."
    )
    ignore_eos: bool = sampled("ignore_eos", description="Keep generating past end-of-sequence.")
    logprobs: int | None = sampled(
        "logprobs",
        description="Write per-token logprobs: 0 the sampled token, k also the top k. Empty: none.",
    )
    stop: list[str] = sampled(
        "stop", [], description='Stop strings (a string, or a JSON list: ["\\n", "###"]).'
    )
    stop_token_ids: list[int] = sampled("stop_token_ids", description="Stop token ids.")
    include_stop_str_in_output: bool = sampled(
        "include_stop_str_in_output", description="Keep the stop string."
    )
    min_tokens: int = sampled("min_tokens", description="Response tokens at least before EOS/stop.")
    min_p: float = sampled("min_p")
    repetition_penalty: float = sampled("repetition_penalty", description="1 disables it.")
    presence_penalty: float = sampled("presence_penalty")
    frequency_penalty: float = sampled("frequency_penalty")
    skip_special_tokens: bool = sampled(
        "skip_special_tokens", description="Leave special tokens out of the text."
    )
    # Not the request's seed (`SamplingParams.seed`): each request's is derived
    # from this one. The engines and the policy are seeded with it too.
    seed: int = Field(
        42,
        ge=0,
        le=2**62,
        description="Base seed. A request's seed is derived from it, the iteration and the "
        "prompt's index, so a rollout does not depend on which engine served it.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    def request(self) -> SamplingParams:
        """Sampling parameters shared by every request (each gets its own seed).
        The vLLM-named fields go through when set: `SamplingParams` refuses one
        its backend cannot honour, naming it, rather than dropping it."""
        values = {name: getattr(self, name) for name in ALWAYS_SAMPLED}
        values.update(
            {
                name: getattr(self, name)
                for name in SAMPLED_WHEN_SET
                if name in self.model_fields_set
            }
        )
        return SamplingParams(**values)


ALWAYS_SAMPLED = ("n", "temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "logprobs")
#: vLLM's per-request fields; at their defaults they mean what vLLM's defaults mean.
SAMPLED_WHEN_SET = (
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_tokens",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
)
