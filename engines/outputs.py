"""RequestOutput-like results, shaped after vLLM's, as plain picklable data.

Logprobs are `{token_id: logprob}` dicts per position (vLLM has `Logprob`
objects there): the sampled token is always present, plus the top-k asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | None while unfinished
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    weight_version: int
    engine: str
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
