"""A session's turns -> `TrajectorySample`s, from the ids the engine gave back.

Each recorded turn is what one n=1 request returned with `return_token_ids`:
the prompt ids the engine rendered, the ids it sampled, their logprobs and
the weight version of each. Turn k's prompt must start with the stream so
far (the first prompt, then every token since); the tokens it adds are the
environment's and the template's (mask 0), then the sampled ones (mask 1).
A prompt that does not start with the stream splits the trajectory: a new
sample starts with that prompt and says where the two differ. Ids are never
re-rendered, dropped or changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engines.trajectory import NOT_SAMPLED, TrajectorySample, TurnSpan


class TurnParseError(ValueError):
    """An engine response that cannot be recorded exactly (a field missing or misaligned)."""


@dataclass(frozen=True)
class SampledTurn:
    """One request's exact tokens, as the engine answered it."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    engine: str

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise TurnParseError(f"engine {self.engine} rendered an empty prompt")
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise TurnParseError(
                f"engine {self.engine}: {n} sampled ids, {len(self.logprobs)} logprobs, "
                f"{len(self.token_versions)} versions"
            )


@dataclass(frozen=True)
class Mismatch:
    """Where a turn's prompt leaves the stream: the first differing position
    (in prompt + response ids) and the token each side has there (None: that
    side ends before it)."""

    position: int
    stream_token: int | None
    prompt_token: int | None


def parse_turn(
    body: dict[str, Any],
    kind: Literal["chat", "completion"],
    engine: str,
    header_versions: list[int],
) -> SampledTurn:
    """The exact tokens of an n=1 response body (vLLM's shapes with
    `return_token_ids` and logprobs). Versions: the choice's `token_versions`
    when the engine gives them; else, with a single version for the request,
    that one; with several and no per-token list, the oldest (a lower bound on
    every token's version)."""
    try:
        choice = body["choices"][0]
        prompt = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
        ids = choice["token_ids"]
        logprobs = _logprobs(choice.get("logprobs"), kind)
    except (KeyError, IndexError, TypeError) as exc:
        raise TurnParseError(
            f"engine {engine} returned no token ids or logprobs to record ({exc!r}); "
            f"the router asks for return_token_ids and logprobs"
        ) from exc
    if prompt is None or ids is None:
        raise TurnParseError(f"engine {engine} returned no prompt_token_ids/token_ids")
    versions = choice.get("token_versions")
    if versions is None:
        request_versions = body.get("weight_versions") or header_versions
        if not request_versions:
            raise TurnParseError(f"engine {engine} named no weight version for its response")
        versions = [min(request_versions)] * len(ids)
    return SampledTurn(list(prompt), list(ids), logprobs, list(versions), engine)


def _logprobs(logprobs: dict[str, Any] | None, kind: str) -> list[float]:
    if logprobs is None:
        raise KeyError("logprobs")
    if kind == "chat":
        return [float(entry["logprob"]) for entry in logprobs["content"]]
    return [float(value) for value in logprobs["token_logprobs"]]


@dataclass
class _Open:
    """The sample being built."""

    prompt: list[int]
    split_reason: str | None
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)

    def extend(self, role: str, ids: list[int], logprobs, versions, engine) -> None:
        start = len(self.response)
        sampled = role == "assistant"
        self.response += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if sampled else [0.0] * len(ids)
        self.versions += versions if sampled else [NOT_SAMPLED] * len(ids)
        self.turns.append(TurnSpan(role=role, start=start, stop=len(self.response), engine=engine))

    def sample(self) -> TrajectorySample:
        return TrajectorySample(
            prompt_token_ids=self.prompt,
            response_token_ids=self.response,
            loss_mask=self.mask,
            logprobs=self.logprobs,
            token_versions=self.versions,
            turns=self.turns,
            split_reason=self.split_reason,
        )


class TrajectoryBuilder:
    """One session's samples, built turn by turn (`add_turn`), read by `samples()`."""

    def __init__(self) -> None:
        self._done: list[TrajectorySample] = []
        self._open: _Open | None = None
        self.turn_count = 0

    def mismatch(self, prompt: list[int]) -> Mismatch | None:
        """None when `prompt` starts with the stream so far (or no turn was
        recorded yet); else where it leaves it."""
        if self._open is None:
            return None
        stream = self._open.prompt + self._open.response
        # The common case in one list comparison: the position-by-position walk
        # below cost the router milliseconds a turn on a 2k-token conversation.
        if prompt[: len(stream)] == stream:
            return None
        for position, token in enumerate(stream):
            if position >= len(prompt):
                return Mismatch(position, token, None)
            if prompt[position] != token:
                return Mismatch(position, token, prompt[position])
        return None

    def add_turn(self, turn: SampledTurn, split_reason: str | None = None) -> None:
        """Record a turn. A turn whose prompt leaves the stream needs
        `split_reason` (see `describe_split`) and starts a new sample."""
        found = self.mismatch(turn.prompt_token_ids)
        self.turn_count += 1
        if self._open is None or found is not None:
            if found is not None and not split_reason:
                raise ValueError(f"turn {self.turn_count} leaves the stream at {found}: name why")
            if self._open is not None:
                self._done.append(self._open.sample())
            self._open = _Open(prompt=list(turn.prompt_token_ids), split_reason=split_reason)
        else:
            stream = len(self._open.prompt) + len(self._open.response)
            between = turn.prompt_token_ids[stream:]
            if between:
                self._open.extend("environment", between, [], [], None)
        self._open.extend(
            "assistant", turn.token_ids, turn.logprobs, turn.token_versions, turn.engine
        )

    def samples(self) -> list[TrajectorySample]:
        """Every sample so far, in order (the open one last)."""
        return self._done + ([self._open.sample()] if self._open is not None else [])


def describe_split(
    turn_number: int, found: Mismatch, stream_text: str | None, prompt_text: str | None
) -> str:
    """The `split_reason` of a new sample: the turn, the first differing
    position, and the two tokens (id and text; "end" where a side ended)."""

    def side(token: int | None, text: str | None) -> str:
        return "end" if token is None else f"{token} {text!r}"

    return (
        f"turn {turn_number}: its prompt leaves the token stream at position "
        f"{found.position}: the stream has {side(found.stream_token, stream_text)}, "
        f"the prompt has {side(found.prompt_token, prompt_text)} (a chat template or "
        f"agent that rewrote history, or a retokenization that differs)"
    )
