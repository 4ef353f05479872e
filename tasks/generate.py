"""The generation task: one iteration's rollouts, shard by shard, written
exactly once. With a reward, each shard is scored (in Ray) before it is
written, so its rows carry their reward and the advantage the policy uses."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines import SamplingParams
from engines.client import get
from tasks.engines import retry_on_engine_failure, wait_ready
from tasks.run.dispatch import run_shards
from tasks.run.params import ClusterParams, OutputParams
from tasks.run.pool import EnginePool
from tasks.run.progress import IterationProgress
from tasks.run.prompts import PromptRecord, Prompts
from tasks.run.records import request_seed, rows_for, with_input
from tasks.run.segments import record_sampling
from tasks.run.shards import Shard, ShardStore, plan_shards
from training.grpo import group_advantages
from training.rewards import RewardInput, score_remote


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
        total: int,
    ) -> None:
        self.pool, self.prompts, self.plan, self.store = pool, prompts, plan, store
        self.progress, self.scorer, self.total = progress, scorer, total
        self.logger = get_run_logger()
        self.done = self.rows = self.tokens = 0
        self.reward_seconds = 0.0

    def seed_of(self, prompt_index: int) -> int:
        plan = self.plan
        return request_seed(plan.base_seed, plan.iteration, prompt_index, len(self.prompts))

    def submit(self, engine: int, shard: Shard) -> list:
        handle = self.pool.engines[engine]
        return [
            handle.generate_text.remote(
                self.prompts.records[i].prompt,
                record_sampling(self.plan.sampling, self.prompts.records[i].metadata).model_copy(
                    update={"seed": self.seed_of(i)}
                ),
            )
            for i in range(shard.start, shard.stop)
        ]

    def on_done(self, shard: Shard, engine: int, results: list, seconds: float) -> None:
        plan = self.plan
        rows, inputs = [], []
        for i, output in zip(range(shard.start, shard.stop), results, strict=True):
            record = self.prompts.records[i]
            for row in rows_for(
                output,
                iteration=plan.iteration,
                prompt_index=i,
                prompt=record.prompt,
                seed=self.seed_of(i),
                with_logprobs=plan.sampling.logprobs is not None,
            ):
                rows.append(with_input(row, record))
                inputs.append(record)
        if self.scorer is not None:
            started = time.monotonic()
            add_rewards(rows, inputs, self.scorer, plan.reward_timeout_s)
            self.reward_seconds += time.monotonic() - started
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
    serve the policy's current weights, before it gets work. A generation
    running beside this one waits here (its replacement's three steps each
    have the ready deadline), then finds the engine replaced."""
    logger = get_run_logger()
    timeout_s = plan.cluster.ready_timeout_s
    with pool.replacement(logger, timeout_s, 3 * timeout_s) as replaced:
        if replaced:
            wait_ready(pool, timeout_s)
        if replaced and policy is not None and policy.handle is not None:
            sync = policy.handle.sync_weights.remote(list(pool.engines), reconnect=True)
            report = get(sync, timeout_s)
            logger.info("replacement engine synced to weight version %d", report.version)


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
    replace_failed(pool, plan, policy)
    store = ShardStore(plan.directory, plan.output.output_format, prompts.columns)
    store.remove_partial_files()
    shards = plan_shards(len(prompts), plan.output.shard_size)
    todo = [shard for shard in shards if not store.is_done(shard)]
    writer = ShardWriter(pool, prompts, plan, store, progress, scorer, total=len(shards))
    writer.done = len(shards) - len(todo)
    if writer.done:
        get_run_logger().info(
            "iteration %d: %d of %d shards already written",
            plan.iteration,
            writer.done,
            len(shards),
        )
    reused_rows = (len(prompts) - sum(len(shard) for shard in todo)) * plan.sampling.n
    progress.reused(reused_rows, restarts(pool))
    run_shards(
        pool,
        todo,
        writer.submit,
        writer.on_done,
        per_engine=plan.cluster.shards_per_engine,
        timeout_s=plan.cluster.request_timeout_s,
    )
    return IterationReport(
        iteration=plan.iteration,
        directory=str(plan.directory),
        shards=len(shards),
        shards_skipped=len(shards) - len(todo),
        rows=len(prompts) * plan.sampling.n,
        seconds=round(time.monotonic() - began, 2),
        generated_rows=writer.rows,
        generated_tokens=writer.tokens,
        reward_seconds=round(writer.reward_seconds, 3),
    )


def add_rewards(
    rows: list[dict[str, Any]], inputs: list[PromptRecord], scorer: Any, timeout_s: float
) -> None:
    """Score one shard's rows (`inputs`: each row's input record) in Ray, then
    set each row's reward and its advantage within its prompt's group, as the
    policy step computes it."""
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
    rewards = score_remote(scorer, samples, timeout_s)
    groups: dict[int, list[int]] = {}
    for position, (row, reward) in enumerate(zip(rows, rewards, strict=True)):
        row["reward"] = reward
        groups.setdefault(row["prompt_index"], []).append(position)
    for positions in groups.values():
        positions.sort(key=lambda p: rows[p]["sample_index"])
        advantages = group_advantages([rows[p]["reward"] for p in positions])
        for p, advantage in zip(positions, advantages, strict=True):
            rows[p]["advantage"] = advantage


def restarts(pool: EnginePool) -> int:
    return sum(stats.restarts for stats in pool.stats)
