"""A multi-turn rollout as the trainer takes it: exactly the token ids the
engine saw and sampled, never a re-rendering of the conversation's text.

One `TrajectorySample` is the first turn's prompt followed by a response
stream: the tokens the engine sampled (loss mask 1) interleaved with the
environment's and the chat template's tokens (loss mask 0). When the next
turn's prompt does not start with the stream so far (a chat template that
rewrites history, an agent that edits it), the trajectory is split: a new
sample begins with that prompt, and `split_reason` says why.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The version recorded for tokens no engine sampled (environment, template).
NOT_SAMPLED = -1


class TurnSpan(BaseModel):
    """Where one turn's tokens lie in `response_token_ids`: [start, stop)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["assistant", "environment"]
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    #: The engine that sampled an assistant turn (None for environment turns).
    engine: str | None = None


class TrajectorySample(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=1)
    response_token_ids: list[int]
    #: 1 where the engine sampled the token, 0 for environment and template tokens.
    loss_mask: list[int]
    #: The behaviour logprob of each response token (0.0 where the mask is 0).
    logprobs: list[float]
    #: The weight version that sampled each response token (NOT_SAMPLED where the mask is 0).
    token_versions: list[int]
    turns: list[TurnSpan]
    #: Why this sample starts a new one of the same session (None for the first).
    split_reason: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> TrajectorySample:
        n = len(self.response_token_ids)
        for name in ("loss_mask", "logprobs", "token_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask holds values other than 0 and 1")
        position = 0
        for turn in self.turns:
            if turn.start != position or turn.stop < turn.start:
                raise ValueError(f"turn {turn} does not follow position {position}")
            position = turn.stop
        if position != n:
            raise ValueError(f"the turns cover {position} of {n} response tokens")
        return self

    @property
    def sampled_token_ids(self) -> list[int]:
        return [t for t, m in zip(self.response_token_ids, self.loss_mask, strict=True) if m]
