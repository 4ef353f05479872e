"""A generation's shards turned into rows: `ShardWriter` submits each
shard's requests, and once they have answered makes its rows, scores them
(with a reward, in Ray: each row's reward and its advantage within its
prompt's group), writes them and counts what was generated. An agent run's
shards go through `AgentWriter` (tasks/run/agent_writer.py), built on it."""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger

from tasks.run.dispatch import run_shards
from tasks.run.plans import GenerationPlan
from tasks.run.pool import EnginePool
from tasks.run.progress import IterationProgress
from tasks.run.prompts import PromptRecord, Prompts
from tasks.run.records import record_sampling, request_seed, rows_for, with_input
from tasks.run.shards import Shard, ShardStore, plan_shards
from training.grpo import group_advantages
from training.rewards import RewardInput, score_remote


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
            self.progress.reused(reused_rows, self.pool.restarts)
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
        self.progress.written(len(rows), tokens, self.pool.restarts)
        self.logger.info(
            "iteration %d: shard %d written by %s in %.1fs (%d/%d)",
            plan.iteration,
            shard.index,
            self.pool.name(engine),
            seconds,
            self.done,
            self.total,
        )


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
