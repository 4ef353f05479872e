"""The generation task of the `partial` schedule: one iteration of partial
rollouts (slime's --partial-rollout, AReaL's interruptible generation).

Iteration j keeps `in_flight` groups generating: the groups carried from
j - 1 (their unfinished samples resume under the new weights), then new
ones. It takes the first `batch` groups to complete (the batch `sync` trains
on: one per prompt of the prompts file), aborts what still runs, and carries
the rest to j + 1 (`<run>/partial/carry-<j>.json`).

The wait bound (max_wait, the run's max_staleness, which the policy checks
too): a group whose oldest segment ran under version o (started at
iteration o, or for o + 1 beside o's policy step: `tasks.partial.left`) is
due at o + max_wait. Iteration j stops only when its due groups are
complete as well, and takes them first.
So every group started is trained (none dropped: dropping would bias the
batches toward short samples, the long ones never finishing), by a policy
at most max_wait versions past its oldest token, and one sample spans at
most max_wait + 1 versions. With in_flight <= 2 x batch the due groups
always fit in one batch.

Exactly once: the carry of j is written before j's rows, and a group is in
one of them only. A retry of j finds j's rows written (done) or not (it
starts again from the carry of j - 1, and overwrites the carry of j).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.engines import retry_on_engine_failure
from tasks.generate import start_try
from tasks.partial.left import LeftRunning
from tasks.partial.runner import SegmentRunner
from tasks.partial.segments import CarryStore, GroupState, SampleState
from tasks.run.plans import GenerationPlan, IterationReport, PolicyLink
from tasks.run.pool import EnginePool
from tasks.run.progress import IterationProgress
from tasks.run.prompts import Prompts
from tasks.run.records import record_sampling, rows_for, with_input
from tasks.run.shards import Shard, ShardStore
from tasks.run.writer import add_rewards


@dataclass(frozen=True)
class PartialPlan:
    """Plain data: one iteration of partial rollouts."""

    generation: GenerationPlan
    #: Groups generating at once (batch to 2 x batch; the batch: the prompts file's rows).
    in_flight: int
    #: Iterations a group may wait for its batch (the run's max_staleness).
    max_wait: int
    #: The groups not taken go on generating while the policy trains (`LeftRunning`).
    keep_generating: bool = False
    #: ... and the next iteration's groups start as they complete (not on the run's last).
    start_next: bool = False


def in_flight_groups(batch: int, factor: float) -> int:
    """Groups kept generating: at most 2 x batch, so that the groups due at
    their wait bound (carried ones, at most in_flight - batch) fit in a batch."""
    if not 1.0 <= factor <= 2.0:
        raise ValueError(f"partial_in_flight must be in [1, 2], got {factor!r}")
    return min(2 * batch, max(batch, math.ceil(batch * factor)))


def group_seed(base_seed: int, iteration: int, slot: int, in_flight: int) -> int:
    """The seed of a group, unique within a run (slots of an iteration never
    reach `in_flight`)."""
    return base_seed + iteration * in_flight + slot


def groups_for(plan: PartialPlan, prompts: Prompts, carried: list[GroupState]) -> list[GroupState]:
    """The carried groups, oldest first, then new ones up to `in_flight`: the
    iteration's first slots but those started beside the step before."""
    iteration = plan.generation.iteration
    groups = sorted(carried, key=lambda c: (c.origin, c.slot))
    started = {c.slot for c in carried if c.origin == iteration}
    slots = [slot for slot in range(plan.in_flight) if slot not in started]
    return groups + new_groups(plan, prompts, iteration, slots[: plan.in_flight - len(groups)])


def next_groups(plan: PartialPlan, prompts: Prompts, rest: list[GroupState]) -> list[GroupState]:
    """The next iteration's new groups, to start beside the policy step
    (`PartialPlan.start_next`): as many as it would start. They are one
    version older than their origin; with a wait bound of 1 they are due
    next iteration, so no more than fit in its batch beside the groups of
    `rest` (this iteration's carry) due then."""
    following = plan.generation.iteration + 1
    count = plan.in_flight - len(rest)
    if plan.max_wait <= 1:
        due = sum(group.waited(following) >= plan.max_wait for group in rest)
        count = min(count, len(prompts) - due)
    return new_groups(plan, prompts, following, range(count))


def new_groups(
    plan: PartialPlan, prompts: Prompts, iteration: int, slots: Iterable[int]
) -> list[GroupState]:
    """Groups not started yet, of `iteration` at `slots` (their prompts cycle
    through the prompts file, each group with its own seed)."""
    g, made = plan.generation, []
    for slot in slots:
        index = slot % len(prompts)
        sampling = record_sampling(g.sampling, prompts.records[index].metadata)
        if sampling.max_tokens is None:
            raise ValueError("the partial schedule needs max_tokens (each sample's budget)")
        samples = [SampleState(index=k, budget=sampling.max_tokens) for k in range(g.sampling.n)]
        seed = group_seed(g.base_seed, iteration, slot, plan.in_flight)
        made.append(GroupState(iteration, slot, index, seed, samples))
    return made


@task(
    cache_policy=NO_CACHE,
    persist_result=False,
    retry_condition_fn=retry_on_engine_failure,
    task_run_name="generate-partial-iter-{plan.generation.iteration}",
)
def generate_partial_rollouts(
    pool: EnginePool,
    prompts: Prompts,
    plan: PartialPlan,
    progress: IterationProgress,
    policy: PolicyLink | None = None,
    scorer: Any = None,
    left: LeftRunning | None = None,
) -> IterationReport:
    """Generate iteration `plan.generation.iteration` of a `partial` run;
    with `plan.keep_generating`, what is not taken runs on in `left`."""
    began = time.monotonic()
    g, logger = plan.generation, get_run_logger()
    store = start_try(pool, g, policy, prompts)
    carry = CarryStore(g.run_dir)
    batch = len(prompts)
    shard = Shard(0, 0, batch)
    report = dict(
        iteration=g.iteration, directory=str(g.directory), shards=1, rows=batch * g.sampling.n
    )
    if store.is_done(shard) and carry.path(g.iteration).exists():
        progress.reused(batch * g.sampling.n, pool.restarts)
        return IterationReport(
            **report, shards_skipped=1, seconds=0.0, generated_rows=0, generated_tokens=0
        )
    carried = carried_groups(left, carry, g.iteration - 1)
    due = [c for c in carried if c.waited(g.iteration) >= plan.max_wait]
    runner = SegmentRunner(
        pool,
        prompts.texts,
        g.sampling,
        batch=batch,
        timeout_s=g.cluster.request_timeout_s,
        abort_timeout_s=g.cluster.ready_timeout_s,
    )
    keep = plan.keep_generating and left is not None
    completed = runner.run(groups_for(plan, prompts, carried), due, keep_running=keep)
    try:
        taken = take_batch(completed, due, batch)
        if taken is None:
            raise RuntimeError(
                f"iteration {g.iteration}: {len(completed)} of {batch} groups completed, "
                f"{len(due)} due, with {plan.in_flight} in flight"
            )
        taken_ids = {id(group) for group in taken}
        rest = [group for group in runner.groups if id(group) not in taken_ids]
        carry.write(g.iteration, rest)
        rows, reward_s = write_rows(store, shard, prompts, g, taken, scorer)
    except BaseException:
        runner.abandon()
        raise
    counts = runner.counts
    progress.written(len(rows), counts.tokens, pool.restarts)
    early = sum(c.origin == g.iteration for c in carried)
    logger.info(
        "iteration %d: %d groups taken (%d at their wait bound), %d carried; "
        "%d segments (%d resumed, %d aborted), %d tokens%s",
        g.iteration,
        len(taken),
        len(due),
        len(rest),
        counts.sent,
        counts.resumed,
        counts.aborted,
        counts.tokens,
        f"; {early} of its groups started beside the last step" if early else "",
    )
    done = IterationReport(
        **report,
        shards_skipped=0,
        seconds=round(time.monotonic() - began, 2),
        generated_rows=len(rows),
        generated_tokens=counts.tokens,
        reward_seconds=round(reward_s, 3),
    )
    if keep:  # once the counts are read: the rest goes on in another thread
        following = next_groups(plan, prompts, rest) if plan.start_next else []
        left.hold(runner, carry, g.iteration, rest, following)
    return done


def carried_groups(left: LeftRunning | None, carry: CarryStore, iteration: int) -> list[GroupState]:
    """The groups `iteration` carries to the next: from the stop that wrote
    them when it ran in this process (`LeftRunning.carried`), else from the
    file (the first iteration after a resume, a retry)."""
    carried = left.carried(iteration) if left is not None else None
    return carry.load(iteration) if carried is None else carried


def take_batch(
    completed: list[GroupState], due: list[GroupState], batch: int
) -> list[GroupState] | None:
    """The groups a step trains on: the due ones first, then the first to
    complete; None when they are not a full batch of complete groups with
    every due one."""
    due_ids = {id(group) for group in due}
    taken = (due + [group for group in completed if id(group) not in due_ids])[:batch]
    taken_ids = {id(group) for group in taken}
    if len(taken) < batch or not due_ids <= taken_ids or not all(t.complete for t in taken):
        return None
    return taken


def write_rows(
    store: ShardStore,
    shard: Shard,
    prompts: Prompts,
    g: GenerationPlan,
    taken: list[GroupState],
    scorer: Any,
) -> tuple[list[dict[str, Any]], float]:
    """The batch's rows, scored, in one shard. A row's `prompt_index` is its
    group's place in the batch (the policy groups by it; a prompt may run in
    two groups at once), its `id` and `seed` name the prompt and the group."""
    rows, inputs = [], []
    for position, group in enumerate(taken):
        record = prompts.records[group.prompt_index]
        output = group.output(f"partial-{group.origin}-{group.slot}")
        made = rows_for(
            output,
            iteration=g.iteration,
            prompt_index=position,
            prompt=record.prompt,
            seed=group.seed,
            with_logprobs=g.sampling.logprobs is not None,
        )
        for row, sample in zip(made, group.samples, strict=True):
            # The sample's own versions, not its group's (rows_for's).
            versions = sample.all_versions()
            row.update(weight_version=versions[0], weight_versions=versions)
            rows.append(with_input(row, record))
            inputs.append(record)
    reward_s = 0.0
    if scorer is not None:
        started = time.monotonic()
        add_rewards(rows, inputs, scorer, g.reward_timeout_s)
        reward_s = time.monotonic() - started
    store.write(shard, rows)
    return rows, reward_s
