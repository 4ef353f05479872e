"""The generation task: one iteration's rollouts, shard by shard, written
exactly once (tasks/run/writer.py). With a reward, each shard is scored (in
Ray) before it is written, so its rows carry their reward and the advantage
the policy uses. A try's start (a failed engine replaced first) is shared
with the partial schedule's task (tasks/partial/task.py).

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
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.engines import replacing_failed, retry_on_engine_failure
from tasks.run.agent_writer import AgentWriter
from tasks.run.plans import GenerationPlan, IterationReport, PolicyLink
from tasks.run.pool import EnginePool
from tasks.run.progress import IterationProgress
from tasks.run.prompts import Prompts
from tasks.run.shards import ShardStore
from tasks.run.writer import ShardWriter
from tasks.sync_weights import push_weights

#: What dynamic sampling reads back of a round's rows.
READ_BACK = ["prompt_index", "filtered", "reward"]


def replace_failed(pool: EnginePool, plan: GenerationPlan, policy: PolicyLink | None) -> None:
    """A retry after an engine failure: the dead engine is replaced first (a
    warm spare woken, or a new engine on its bundle) and must be up, and
    serve the policy's current weights, before it gets work; an agent run's
    router then routes to it. A generation running beside this one, or the
    flow's weight sync, waits here (its replacement's steps each have the
    ready deadline), then finds the engine replaced."""
    timeout_s = plan.cluster.ready_timeout_s
    router = plan.agent.router if plan.agent is not None else None
    with replacing_failed(pool, timeout_s, router) as replaced:
        if replaced and policy is not None and policy.handle is not None:
            report = push_weights(policy.handle, pool, timeout_s, connect=False, reconnect=True)
            get_run_logger().info("replacement engine synced to weight version %d", report.version)


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
    kind = ShardWriter if plan.agent is None else AgentWriter
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
