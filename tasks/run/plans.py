"""What a generation task is given and what it reports: the iteration's
plan (plain data), the link to an on-policy run's trainer, and the
iteration's report. Both generation tasks (tasks/generate.py,
tasks/partial/task.py) take and return these; the flow builds the plans
(flows/iterations.py) and publishes the reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.runner import AgentPlan
from engines import SamplingParams
from tasks.run.params import ClusterParams, OutputParams


@dataclass(frozen=True)
class GenerationPlan:
    """Plain data: what one iteration generates and where it goes."""

    run_dir: str
    iteration: int
    sampling: SamplingParams
    base_seed: int
    output: OutputParams
    #: Shards per engine and the deadlines of a shard and of a replacement.
    cluster: ClusterParams
    #: Deadline for the reward on one shard.
    reward_timeout_s: float = 300.0
    #: Dynamic sampling: the most refill rounds (None: off, no group is filtered).
    max_refill_rounds: int | None = None
    #: An agent run: each prompt's `n` samples are agent sessions.
    agent: AgentPlan | None = None

    @property
    def directory(self) -> Path:
        return Path(self.run_dir) / f"iter-{self.iteration:03d}"


@dataclass(frozen=True)
class IterationReport:
    iteration: int
    directory: str
    shards: int
    #: Shards already written when the last try began (by an earlier attempt
    #: of the run, or an earlier try of this task).
    shards_skipped: int
    rows: int
    seconds: float
    #: Rows and response tokens this try generated (reused shards not counted).
    generated_rows: int
    generated_tokens: int
    #: Time spent waiting for rewards (the flow waits; the reward runs in Ray).
    reward_seconds: float = 0.0
    #: Dynamic sampling: groups generated in every round, those filtered
    #: (rewards all agree), and the refill rounds run.
    groups: int = 0
    filtered_groups: int | None = None
    refill_rounds: int = 0
    #: Dynamic sampling: the reward of the iteration's own samples (its first
    #: round), as a run without it reports; the step's covers what it kept.
    reward_mean: float | None = None
    reward_std: float | None = None


class PolicyLink:
    """An on-policy run's trainer as its generations see it: `handle` is set
    once a sync has connected it to the engines (before that every engine, a
    replacement too, serves the weights it loaded). Read when an engine is
    replaced, not when the task starts: under in_flight a generation may start
    before the first sync and replace an engine after it. A plain object, so
    Prefect passes the flow's own instance to the task."""

    def __init__(self) -> None:
        self.handle: Any = None
