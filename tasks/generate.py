"""The generation task: one iteration's rollouts, shard by shard, written
exactly once. With a reward, each shard is scored (in Ray) before it is
written, so its rows carry their reward and the advantage the policy uses.

Dynamic sampling (DAPO's filter_groups): a group whose rewards all agree
teaches the policy nothing; its rows are written marked `filtered`, and
refill rounds (further shards of the iteration, with seeds of their own)
sample more groups until the batch again holds one group with signal per
prompt of the iteration, or the rounds run out. Every prompt is in round 0,
so a refill samples again the prompts that showed signal (the policy's
frontier: a prompt it answers all right or all wrong tends to stay so),
each once per round; when none did, the filtered ones.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from agents.runner import AgentPlan
from engines import SamplingParams
from engines.client import get
from tasks.engines import retry_on_engine_failure, wait_ready
from tasks.partial.segments import record_sampling
from tasks.run.dispatch import run_shards
from tasks.run.params import ClusterParams, OutputParams
from tasks.run.pool import EnginePool
from tasks.run.progress import IterationProgress
from tasks.run.prompts import PromptRecord, Prompts
from tasks.run.records import request_seed, rows_for, with_input
from tasks.run.shards import Shard, ShardStore, plan_shards
from training.grpo import group_advantages
from training.rewards import RewardInput, score_remote

#: What dynamic sampling reads back of a round's rows.
READ_BACK = ["prompt_index", "filtered", "reward"]


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


class ShardWriter:
    """Turns each finished shard's outputs into rows (scored first, with a
    reward), writes them and counts what was generated."""

    def __init__(
        self,
        pool: EnginePool,
        prompts: Prompts,
        plan: GenerationPlan,
        store: ShardStore,
        progress: IterationProgress,
        scorer: Any,
    ) -> None:
        self.pool, self.prompts, self.plan, self.store = pool, prompts, plan, store
        self.progress, self.scorer = progress, scorer
        self.logger = get_run_logger()
        # Shards: in every round, written, and found written when their round began.
        self.total = self.done = self.skipped = 0
        # Rows this try wrote, and those of the shards it found written.
        self.rows = self.tokens = self.reused_rows = 0
        self.reward_seconds = 0.0
        # The round running and its prompts: a shard's positions index `order`.
        self.round, self.order = 0, list(range(len(prompts)))

    def seed_of(self, prompt_index: int) -> int:
        plan = self.plan
        return request_seed(
            plan.base_seed, plan.iteration, prompt_index, len(self.prompts), self.round
        )

    def submit(self, engine: int, shard: Shard) -> list:
        handle = self.pool.engines[engine]
        return [
            handle.generate_text.remote(
                self.prompts.records[i].prompt,
                record_sampling(self.plan.sampling, self.prompts.records[i].metadata).model_copy(
                    update={"seed": self.seed_of(i)}
                ),
            )
            for i in self.order[shard.start : shard.stop]
        ]

    def run_round(self, round_: int, order: list[int]) -> list[Shard]:
        """Generate (or find written) the shards of one round over the
        prompts at `order`; returns its shards."""
        plan = self.plan
        self.round, self.order = round_, order
        shards = plan_shards(len(order), plan.output.shard_size, round_)
        todo = [shard for shard in shards if not self.store.is_done(shard)]
        self.total += len(shards)
        self.done += len(shards) - len(todo)
        self.skipped += len(shards) - len(todo)
        # Counted, not n per prompt: an agent's split session writes a row per piece.
        reused_rows = sum(self.store.count_rows(s) for s in shards if s not in todo)
        self.reused_rows += reused_rows
        if round_ == 0:
            self.progress.reused(reused_rows, restarts(self.pool))
        else:
            self.progress.refill(len(order) * plan.sampling.n, reused_rows)
        if len(todo) < len(shards):
            self.logger.info(
                "iteration %d, round %d: %d of %d shards already written",
                plan.iteration,
                round_,
                len(shards) - len(todo),
                len(shards),
            )
        run_shards(
            self.pool,
            todo,
            self.submit,
            self.on_done,
            per_engine=plan.cluster.shards_per_engine,
            timeout_s=plan.cluster.request_timeout_s,
        )
        return shards

    def rows_of(self, shard: Shard, results: list) -> list[dict[str, Any]]:
        """A finished shard's rows, scored when the run has a reward."""
        plan = self.plan
        rows, inputs = [], []
        for i, output in zip(self.order[shard.start : shard.stop], results, strict=True):
            record = self.prompts.records[i]
            for row in rows_for(
                output,
                iteration=plan.iteration,
                prompt_index=i,
                prompt=record.prompt,
                seed=self.seed_of(i),
                with_logprobs=plan.sampling.logprobs is not None,
            ):
                row["refill_round"] = self.round
                rows.append(with_input(row, record))
                inputs.append(record)
        if self.scorer is not None:
            started = time.monotonic()
            filtering = plan.max_refill_rounds is not None
            add_rewards(rows, inputs, self.scorer, plan.reward_timeout_s, filtering)
            self.reward_seconds += time.monotonic() - started
        return rows

    def on_done(self, shard: Shard, engine: int, results: list, seconds: float) -> None:
        plan = self.plan
        rows = self.rows_of(shard, results)
        self.store.write(shard, rows)
        tokens = sum(len(row["response_token_ids"]) for row in rows)
        stats = self.pool.stats[engine]
        stats.prompts += len(shard)
        stats.samples += len(rows)
        stats.tokens += tokens
        self.done += 1
        self.rows += len(rows)
        self.tokens += tokens
        self.progress.written(len(rows), tokens, restarts(self.pool))
        self.logger.info(
            "iteration %d: shard %d written by %s in %.1fs (%d/%d)",
            plan.iteration,
            shard.index,
            self.pool.name(engine),
            seconds,
            self.done,
            self.total,
        )


def replace_failed(pool: EnginePool, plan: GenerationPlan, policy: PolicyLink | None) -> None:
    """A retry after an engine failure: the dead engine is replaced first (a
    warm spare woken, or a new engine on its bundle) and must be up, and
    serve the policy's current weights, before it gets work; an agent run's
    router then routes to it. A generation running beside this one waits here
    (its replacement's steps each have the ready deadline), then finds the
    engine replaced."""
    logger = get_run_logger()
    timeout_s = plan.cluster.ready_timeout_s
    with pool.replacement(logger, timeout_s, 3 * timeout_s) as replaced:
        if replaced:
            wait_ready(pool, timeout_s)
        if replaced and policy is not None and policy.handle is not None:
            sync = policy.handle.sync_weights.remote(list(pool.engines), reconnect=True)
            report = get(sync, timeout_s)
            logger.info("replacement engine synced to weight version %d", report.version)
        router = plan.agent.router if plan.agent is not None else None
        if replaced and router is not None:  # it must route to the replacements
            names = get(router.set_engines.remote(list(pool.engines), timeout_s), timeout_s)
            logger.info("the router routes to %s", names)


def start_try(
    pool: EnginePool, plan: GenerationPlan, policy: PolicyLink | None, prompts: Prompts
) -> ShardStore:
    """The start of a generation task's try: a failed engine replaced, and the
    iteration's shard store, without the partial files an earlier try left."""
    replace_failed(pool, plan, policy)
    store = ShardStore(plan.directory, plan.output.output_format, prompts.columns)
    store.remove_partial_files()
    return store


@task(
    cache_policy=NO_CACHE,
    persist_result=False,
    retry_condition_fn=retry_on_engine_failure,
    task_run_name="generate-iter-{plan.iteration}",
)
def generate_rollouts(
    pool: EnginePool,
    prompts: Prompts,
    plan: GenerationPlan,
    progress: IterationProgress,
    policy: PolicyLink | None = None,
    scorer: Any = None,
) -> IterationReport:
    """`policy`: the trainer of an on-policy run; a replacement engine gets its
    current weights before any work, so it never serves an older version.
    `scorer`: a `RewardScorer` actor scoring each shard before it is written."""
    began = time.monotonic()
    store = start_try(pool, plan, policy, prompts)
    kind = ShardWriter
    if plan.agent is not None:
        from tasks.run.agent_writer import AgentWriter  # it builds on ShardWriter

        kind = AgentWriter
    writer = kind(pool, prompts, plan, store, progress, scorer)
    order, groups, round_ = list(range(len(prompts))), 0, 0
    refill = None if plan.max_refill_rounds is None else Refill(len(prompts))
    while True:
        shards = writer.run_round(round_, order)
        groups += len(order)
        if refill is None:
            break
        # Read back from the shards (this try's or an earlier one's), so a
        # retry plans the same refill as the try before it.
        order = refill.next_round([row for s in shards for row in store.read(s, READ_BACK)])
        if not order:
            break
        if round_ == plan.max_refill_rounds:
            get_run_logger().warning(
                "iteration %d: dynamic sampling reached max_refill_rounds=%d with %d of %d "
                "groups with learning signal (the others' rewards all agree); the step "
                "trains on those %d",
                plan.iteration,
                plan.max_refill_rounds,
                len(refill.signal),
                refill.batch,
                len(refill.signal),
            )
            break
        round_ += 1
    return IterationReport(
        iteration=plan.iteration,
        directory=str(plan.directory),
        shards=writer.total,
        shards_skipped=writer.skipped,
        rows=writer.reused_rows + writer.rows,
        seconds=round(time.monotonic() - began, 2),
        generated_rows=writer.rows,
        generated_tokens=writer.tokens,
        reward_seconds=round(writer.reward_seconds, 3),
        groups=groups,
        filtered_groups=None if refill is None else refill.filtered,
        refill_rounds=round_,
        reward_mean=None if refill is None else statistics.fmean(refill.rewards),
        reward_std=None if refill is None else statistics.pstdev(refill.rewards),
    )


@dataclass
class Refill:
    """Dynamic sampling's account of one iteration: `batch` groups with
    signal wanted, one per prompt of the iteration."""

    batch: int
    #: The prompt of each group with signal so far, round by round.
    signal: list[int] = field(default_factory=list)
    filtered: int = 0
    #: The rewards of the iteration's own samples (round 0).
    rewards: list[float] = field(default_factory=list)

    def next_round(self, rows: list[dict[str, Any]]) -> list[int]:
        """File a round's rows; returns the prompts of the next round (none:
        the batch is full)."""
        flat = sorted({row["prompt_index"] for row in rows if row["filtered"]})
        self.signal += sorted({row["prompt_index"] for row in rows if not row["filtered"]})
        self.filtered += len(flat)
        if not self.rewards:
            self.rewards = [row["reward"] for row in rows]
        deficit = self.batch - len(self.signal)
        return (sorted(set(self.signal)) or flat)[: max(0, deficit)]


def add_rewards(
    rows: list[dict[str, Any]],
    inputs: list[PromptRecord],
    scorer: Any,
    timeout_s: float,
    filtering: bool = False,
) -> None:
    """Score one shard's rows (`inputs`: each row's input record) in Ray, then
    set each row's reward and advantage (`add_advantages`)."""
    samples = [
        RewardInput(
            id=record.id,
            sample=row["sample_index"],
            prompt=row["prompt"],
            response=row["response"],
            prompt_token_ids=row["prompt_token_ids"],
            response_token_ids=row["response_token_ids"],
            label=record.label,
            metadata=record.metadata,
        )
        for row, record in zip(rows, inputs, strict=True)
    ]
    for row, reward in zip(rows, score_remote(scorer, samples, timeout_s), strict=True):
        row["reward"] = reward
    add_advantages(rows, filtering)


def add_advantages(rows: list[dict[str, Any]], filtering: bool = False) -> None:
    """Each row's advantage within its prompt's group, as the policy step
    computes it; `filtering` (dynamic sampling): mark the rows of a group
    whose rewards all agree (no advantage) `filtered`."""
    groups: dict[int, list[int]] = {}
    for position, row in enumerate(rows):
        groups.setdefault(row["prompt_index"], []).append(position)
    for positions in groups.values():
        positions.sort(key=lambda p: rows[p]["sample_index"])
        advantages = group_advantages([rows[p]["reward"] for p in positions])
        for p, advantage in zip(positions, advantages, strict=True):
            rows[p]["advantage"] = advantage
            if filtering:
                rows[p]["filtered"] = not any(advantages)


def restarts(pool: EnginePool) -> int:
    return sum(stats.restarts for stats in pool.stats)
