"""The generation task: one iteration's rollouts, shard by shard, written
exactly once."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines import SamplingParams
from engines.client import get
from tasks.artifacts import update_progress
from tasks.dispatch import run_shards
from tasks.engines import retry_on_engine_failure, wait_ready
from tasks.pool import EnginePool
from tasks.prompts import Prompts
from tasks.records import request_seed, rows_for
from tasks.shards import Shard, ShardStore, plan_shards


@dataclass(frozen=True)
class GenerationPlan:
    """Plain data: what one iteration generates and where it goes."""

    run_dir: str
    iteration: int
    sampling: SamplingParams
    base_seed: int
    shard_size: int
    output_format: str
    shards_per_engine: int
    request_timeout_s: float
    ready_timeout_s: float

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
    progress_id: UUID,
    policy: Any = None,
) -> IterationReport:
    """`policy`: the trainer of an on-policy run; a replacement engine gets its
    current weights before any work, so an iteration never mixes versions."""
    logger = get_run_logger()
    began = time.monotonic()
    # A retry after an engine failure: the dead engine is replaced first (same
    # name, config and bundle) and must be up before it gets work.
    if pool.replace_failed(logger):
        wait_ready(pool, plan.ready_timeout_s)
        if policy is not None:
            report = get(policy.sync_weights.remote(list(pool.engines)), plan.ready_timeout_s)
            logger.info("replacement engine synced to weight version %d", report["version"])

    store = ShardStore(plan.directory, plan.output_format)
    store.remove_partial_files()
    shards = plan_shards(len(prompts), plan.shard_size)
    todo = [shard for shard in shards if not store.is_done(shard)]
    done = len(shards) - len(todo)
    if done:
        logger.info(
            "iteration %d: %d of %d shards already written", plan.iteration, done, len(shards)
        )
    update_progress(progress_id, done, len(shards))

    def submit(engine: int, shard: Shard) -> list:
        handle = pool.engines[engine]
        return [
            handle.generate_text.remote(
                prompts.texts[i],
                plan.sampling.model_copy(update={"seed": seed_of(i)}),
            )
            for i in range(shard.start, shard.stop)
        ]

    def seed_of(prompt_index: int) -> int:
        return request_seed(plan.base_seed, plan.iteration, prompt_index, len(prompts))

    def on_done(shard: Shard, engine: int, results: list, seconds: float) -> None:
        nonlocal done
        rows = []
        for i, (output,) in zip(range(shard.start, shard.stop), results, strict=True):
            rows += rows_for(
                output,
                iteration=plan.iteration,
                prompt_index=i,
                prompt=prompts.texts[i],
                seed=seed_of(i),
                with_logprobs=plan.sampling.logprobs is not None,
            )
        store.write(shard, rows)
        stats = pool.stats[engine]
        stats.prompts += len(shard)
        stats.samples += len(rows)
        stats.tokens += sum(len(row["response_token_ids"]) for row in rows)
        done += 1
        update_progress(progress_id, done, len(shards))
        logger.info(
            "iteration %d: shard %d written by %s in %.1fs (%d/%d)",
            plan.iteration,
            shard.index,
            pool.name(engine),
            seconds,
            done,
            len(shards),
        )

    run_shards(
        pool,
        todo,
        submit,
        on_done,
        per_engine=plan.shards_per_engine,
        timeout_s=plan.request_timeout_s,
    )
    return IterationReport(
        iteration=plan.iteration,
        directory=str(plan.directory),
        shards=len(shards),
        shards_skipped=len(shards) - len(todo),
        rows=len(prompts) * plan.sampling.n,
        seconds=round(time.monotonic() - began, 2),
    )
