"""Partial rollouts, sample by sample: a sample is generated in segments, one
request each. A segment ends when the sample does ("stop", "length") or when
its engine aborts it at a weight sync ("abort", with the tokens so far); the
next segment resumes it, on any engine and under the weights then served,
from the prompt's token ids followed by the sample's token ids so far (never
re-encoded from text: no re-prefill drift), with max_tokens reduced by what
was generated. Every token keeps the weight version that sampled it and the
behaviour logprob of that version.

Plain data (JSON through `to_json` / `from_json`): the samples not finished
at an iteration's end are carried to the next one on disk (`CarryStore`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from engines.outputs import CompletionOutput, Logprob, RequestOutput
from engines.sampling import SamplingParams
from tasks.run.shards import write_atomically

#: A segment's end that resumes: the engine stopped it (a sync's abort).
RESUMED_REASONS = ("abort", None)


def segment_seed(seed: int, index: int, generated: int) -> int:
    """The seed of one segment: fixed by the group's seed, the sample and the
    tokens it already has, so a rerun (or a retry on another engine) samples
    the same stream from the same point."""
    return ((seed * 1_000_003 + index) * 1_000_003 + generated) % (2**63)


@dataclass
class SampleState:
    """One sample of a group and what its segments generated so far."""

    index: int
    budget: int
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    #: Per token: the sampled token's logprob and the top entries, [[id, logprob], ...].
    positions: list[list[list[float]]] | None = None
    token_versions: list[int] = field(default_factory=list)
    #: The versions each segment ran under, in order (a segment frozen across a sync has two).
    versions: list[int] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    text: str = ""
    cumulative: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    segments: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason not in RESUMED_REASONS

    def request(self, sampling: SamplingParams, seed: int) -> SamplingParams:
        """The next segment's sampling: one sample, the budget left, its own seed."""
        made = len(self.token_ids)
        return sampling.model_copy(
            update={
                "n": 1,
                "seed": segment_seed(seed, self.index, made),
                "max_tokens": self.budget - made,
                "min_tokens": max(0, sampling.min_tokens - made),
            }
        )

    def prompt(self) -> list[int]:
        """The next segment's prompt: the prompt's token ids, then the sample's."""
        return self.prompt_token_ids + self.token_ids

    def absorb(self, output: RequestOutput, sample: CompletionOutput) -> None:
        """Append one segment's answer (`sample`, one of `output`'s) to the sample."""
        if not self.prompt_token_ids:
            self.prompt_token_ids = list(output.prompt_token_ids)
        tokens = list(sample.token_ids)
        versions = sample.token_versions
        if versions is None:  # the backend cannot tell: the version it was admitted under
            versions = [output.weight_version] * len(tokens)
        if sample.logprobs is not None:
            self.positions = (self.positions or []) + [
                [[token, float(position[token].logprob)]]
                + [[t, float(e.logprob)] for t, e in position.items() if t != token]
                for position, token in zip(sample.logprobs, tokens, strict=True)
            ]
        self.token_ids += tokens
        self.token_versions += list(versions)
        self.versions += [v for v in output.weight_versions if v not in self.versions]
        self.engines.append(output.engine)
        self.text += sample.text
        self.cumulative += sample.cumulative_logprob or 0.0
        self.finish_reason, self.stop_reason = sample.finish_reason, sample.stop_reason
        self.segments += 1

    def finite(self) -> bool:
        """Whether every logprob it holds is a finite float (a NaN or an
        infinity in any makes the sum one)."""
        held = (lp for position in self.positions or () for _, lp in position)
        return math.isfinite(self.cumulative + sum(held))

    def all_versions(self) -> list[int]:
        """Every version a segment of the sample ran under, oldest first."""
        return sorted(set(self.versions) | set(self.token_versions))

    def completion(self) -> CompletionOutput:
        logprobs = None
        if self.positions is not None:
            logprobs = [{int(t): Logprob(logprob=lp) for t, lp in pos} for pos in self.positions]
        return CompletionOutput(
            index=self.index,
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            logprobs=logprobs,
            cumulative_logprob=self.cumulative,
            stop_reason=self.stop_reason,
            token_versions=list(self.token_versions),
        )


@dataclass
class GroupState:
    """The samples of one prompt (a GRPO group), started at iteration `origin`."""

    origin: int
    slot: int
    prompt_index: int
    seed: int
    samples: list[SampleState]

    @property
    def complete(self) -> bool:
        return all(sample.done for sample in self.samples)

    def waited(self, iteration: int) -> int:
        """Iterations since the version of the group's oldest segment (its
        origin when none ran yet): the age the policy checks its rows by. A
        group started early (`tasks.partial.left`) is one version older than
        its origin."""
        versions = [v for sample in self.samples for v in sample.all_versions()]
        return iteration - min(versions, default=self.origin)

    def first_request(self, sampling: SamplingParams) -> SamplingParams:
        """A new group's one request: its n samples, its budget and seed."""
        budget = self.samples[0].budget
        update = {"n": len(self.samples), "seed": self.seed, "max_tokens": budget}
        return sampling.model_copy(update=update)

    def output(self, request_id: str) -> RequestOutput:
        """The group as one engine answer (for `tasks.run.records.rows_for`):
        its oldest version, every version any token or segment ran under, and
        every engine that served a segment."""
        versions = sorted({v for s in self.samples for v in s.all_versions()})
        engines = sorted({e for s in self.samples for e in s.engines})
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=list(self.samples[0].prompt_token_ids),
            outputs=[sample.completion() for sample in self.samples],
            weight_version=versions[0],
            weight_versions=versions,
            engine=",".join(engines),
        )

    def to_json(self) -> dict[str, Any]:
        # Shallow: `asdict` deep-copies every per-token list, on the host's
        # critical path twice an iteration (the carry is written when the
        # batch is taken and again at the stop); json needs no copy.
        # Figures: docs/history/benchmarks-diary.md.
        data = dict(vars(self))
        data["samples"] = [dict(vars(sample)) for sample in self.samples]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupState:
        samples = [SampleState(**s) for s in data["samples"]]
        return cls(**{**data, "samples": samples})


class CarryStore:
    """The groups an iteration leaves unfinished, one JSON file per iteration,
    written atomically."""

    def __init__(self, run_dir: str | Path):
        self.directory = Path(run_dir) / "partial"
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, iteration: int) -> Path:
        return self.directory / f"carry-{iteration:03d}.json"

    def load(self, iteration: int) -> list[GroupState]:
        if iteration < 0:
            return []
        path = self.path(iteration)
        if not path.exists():
            raise FileNotFoundError(f"{path}: iteration {iteration}'s carried groups are missing")
        return [GroupState.from_json(g) for g in json.loads(path.read_text())]

    def write(self, iteration: int, groups: list[GroupState]) -> None:
        write_atomically(self.path(iteration), [dumps(groups)])


def dumps(groups: list[GroupState]) -> str:
    """The carry as JSON text. It is written on the sync's path (the stop of
    what ran beside the step) with a logprob per token of every held
    sample; orjson writes it an order of magnitude faster than `json`
    (benchmarks/carry_cost.py). orjson writes a NaN or an infinity as null,
    which would load as no logprob, and refuses an integer past 64 bits (a
    user's seed): such a carry goes through `json`, which writes both as
    `json.loads` reads them back."""
    data = [group.to_json() for group in groups]
    if all(sample.finite() for group in groups for sample in group.samples):
        try:
            return orjson.dumps(data).decode()
        except orjson.JSONEncodeError:
            pass
    return json.dumps(data)
