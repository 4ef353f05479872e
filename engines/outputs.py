"""RequestOutput-like results, shaped after vLLM's (`vllm/outputs.py`), as
plain picklable data.

Logprobs are per position `{token_id: Logprob}` dicts: the sampled token is
always present, plus the top-k asked for. The vLLM backend passes vLLM's own
`Logprob` objects through; the CPU backend builds this module's `Logprob`,
which has the same fields, so `entry[token].logprob` works on either.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's `vllm.logprobs.Logprob`: a token's logprob, its rank in the
    vocabulary (1 is the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsPosition = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while unfinished
    logprobs: list[LogprobsPosition] | None = None
    cumulative_logprob: float | None = None
    # The stop token id or stop string that ended the sample (None: EOS or length).
    stop_reason: int | str | None = None
    # The weight version that sampled each token (None: the backend cannot tell).
    token_versions: list[int] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # The version the request was admitted under (the oldest it ran on).
    weight_version: int
    engine: str
    # Every weight version the request was generated under, oldest first: more
    # than one when a sync ran while the request was frozen by
    # `pause_generation(mode="keep")`.
    weight_versions: list[int] = field(default_factory=list)
    prompt: str | None = None  # the text, for text prompts
    prompt_logprobs: list[LogprobsPosition | None] | None = None
    num_cached_tokens: int | None = None
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.weight_versions:
            self.weight_versions = [self.weight_version]
