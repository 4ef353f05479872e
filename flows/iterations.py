"""The rollout flow's iterations: generate (-> train -> weight sync) as the
run's schedule interleaves them. flows/schedule.py decides; this submits
the Prefect tasks and collects them, and keeps what each iteration made.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.futures import PrefectConcurrentFuture

from agents.runner import AgentPlan
from engines.errors import EngineFailure
from engines.weight_sync import SyncReport
from engines.weight_sync.errors import WeightSyncError
from flows.params import RolloutParams
from flows.schedule import Pipeline
from tasks.generate import generate_rollouts
from tasks.partial.left import LeftRunning
from tasks.partial.task import PartialPlan, generate_partial_rollouts, in_flight_groups
from tasks.run.loggers import MetricsLogger
from tasks.run.plans import GenerationPlan, IterationReport, PolicyLink
from tasks.run.pool import EnginePool
from tasks.run.progress import RunProgress
from tasks.run.prompts import Prompts
from tasks.run.report import IterationMetrics, TrainingRow
from tasks.sync_weights import sync_weights
from tasks.train import train_on_rollouts
from training.trainer import StepReport

#: How long the iteration loop waits on its tasks before it looks again.
STOP_CHECK_S = 0.2


@dataclass
class Ledger:
    """What the iterations produced, kept as they finish: a failed run still
    publishes the rows of the iterations it completed."""

    training: list[TrainingRow]
    metrics: list[IterationMetrics]
    metrics_logger: MetricsLogger | None = None
    reports: dict[int, IterationReport] = field(default_factory=dict)
    steps: dict[int, StepReport] = field(default_factory=dict)
    #: Sync reports by the iteration whose step made the version they published.
    syncs: dict[int, SyncReport] = field(default_factory=dict)
    #: Under `partial`, the seconds of the stop of what ran beside each
    #: iteration's step.
    stop_s: dict[int, float] = field(default_factory=dict)

    def close_iterations(self, pipeline: Pipeline) -> None:
        """Add the rows of every iteration now complete (generated, and on an
        on-policy run trained and its version served), in order."""
        while (i := len(self.metrics)) in self.reports:
            report, step = self.reports[i], self.steps.get(i)
            if pipeline.trains and (step is None or pipeline.served <= i):
                return
            synced = self.syncs.get(i)
            if step is not None:
                self.training.append(
                    TrainingRow.of(
                        report,
                        step,
                        synced,
                        engine_idle_s=pipeline.engine_idle_s[i],
                        policy_idle_s=pipeline.policy_idle_s[i],
                        stop_s=self.stop_s.get(i),
                    )
                )
            self.metrics.append(IterationMetrics.of(report, step, synced))
            if self.metrics_logger is not None:
                self.metrics_logger.log(self.metrics[-1])


def run_iterations(
    params: RolloutParams,
    run_dir: Path,
    pool: EnginePool,
    prompts: Prompts,
    progress: RunProgress,
    policy_up: PrefectConcurrentFuture | None,
    scorer: Any,
    ledger: Ledger,
    agent: AgentPlan | None = None,
) -> float:
    """Generate (-> train -> sync) every iteration, as the run's schedule
    interleaves them (flows/schedule.py decides, this submits): Prefect task
    futures on the flow's task runner, so the UI shows the tasks side by side.

    `policy_up`: on an on-policy run, the future of the policy's start-up
    (its handle). Generation does not wait for it; training waits, and the
    first sync connects the policy to the engines. `agent`: an agent run's
    sessions (agents/runner.py). Returns the seconds nothing ran but the
    policy's start (start-up, as the engines')."""
    training = params.training
    on_policy = policy_up is not None
    pipeline = Pipeline(
        training.iterations, training.schedule, training.staleness_bound, trains=on_policy
    )
    partial = training.schedule_rule.partial
    task = generate_partial_rollouts if partial else generate_rollouts
    generate = task.with_options(retries=params.cluster.engine_retries)
    # An engine dead before or under a sync is replaced by the sync's retry
    # (an agent run's router then routes to the replacement).
    sync = sync_weights.with_options(retries=params.cluster.engine_retries)
    replace = dict(ready_timeout_s=params.cluster.ready_timeout_s, router=agent and agent.router)
    with left_running(partial) as left:
        running: dict[PrefectConcurrentFuture, tuple[str, int]] = {}
        if policy_up is not None:
            running[policy_up] = ("policy", 0)
        policy = None  # the handle, once the policy is up
        # Set once a sync connected the policy: a replacement is synced before it serves.
        link = PolicyLink()
        pipeline.start(time.monotonic())
        while not pipeline.done:
            now = time.monotonic()
            if pipeline.should_sync():
                now = stop_left_running(left, pipeline, ledger)
                pipeline.sync_started(now)
                made_by = pipeline.trained - 1
                connect = link.handle is None
                future = sync.submit(policy, pool, iteration=made_by, connect=connect, **replace)
                running[future] = ("sync", made_by)
            if policy is not None and (i := pipeline.next_training()) is not None:
                pipeline.training_started(i, now)
                future = train_on_rollouts.submit(policy, ledger.reports[i].directory, iteration=i)
                running[future] = ("train", i)
            while (i := pipeline.next_generation()) is not None:  # in_flight: several at once
                pipeline.generation_started(i, now)
                plan = iteration_plan(
                    params, run_dir, i, len(prompts), on_policy=on_policy, agent=agent
                )
                bar = progress.iteration(i, len(prompts) * params.sampling.n)
                future = generate.submit(pool, prompts, plan, bar, link, scorer, *left)
                running[future] = ("generate", i)
            future = first_done(list(running))
            kind, i = running.pop(future)
            now = time.monotonic()
            if kind == "policy":
                policy = future.result()
                pipeline.policy_up(now)
            elif kind == "generate":
                ledger.reports[i] = future.result()
                pipeline.generation_done(i, now)
            elif kind == "train":
                ledger.steps[i] = step = future.result()
                pipeline.training_done(step.version, now)
            elif sync_finished(future, i, pipeline, ledger, now):
                link.handle = policy
            ledger.close_iterations(pipeline)
        return pipeline.startup_wait_s


@contextmanager
def left_running(partial: bool) -> Iterator[tuple[LeftRunning, ...]]:
    """`partial`: what a generation leaves running while the policy trains
    (none under the other schedules). A run that ends before its stop (a
    failure) cancels it; after the last sync nothing is held."""
    left = (LeftRunning(),) if partial else ()
    try:
        yield left
    finally:
        for held in left:
            held.abandon()


def stop_left_running(left: tuple[LeftRunning, ...], pipeline: Pipeline, ledger: Ledger) -> float:
    """Before a sync: stop what `partial` left generating beside the policy
    step. The engines were busy until its last answer, not until the
    generation task's end (nor the stop). Returns the time after the stop."""
    stopped = left[0].stop() if left else None
    if stopped is not None:
        if stopped.busy_until is not None:
            pipeline.engines_busy(stopped.busy_until)
        ledger.stop_s[stopped.iteration] = stopped.seconds
        get_run_logger().info(
            "iteration %d: what ran beside the step stopped in %.3f s (thread %.3f, "
            "the engines' abort %.3f, the aborted segments' answers %.3f, the carry %.3f)",
            stopped.iteration,
            stopped.seconds,
            stopped.join_s,
            stopped.abort_s,
            stopped.answers_s,
            stopped.carry_s,
        )
    return time.monotonic()


def sync_finished(
    future: PrefectConcurrentFuture, made_by: int, pipeline: Pipeline, ledger: Ledger, now: float
) -> bool:
    """Record a finished sync; False when it failed and will be retried."""
    try:
        synced = future.result()
    except (EngineFailure, WeightSyncError) as exc:
        # What the sync's own retries (each replaces dead engines first) did
        # not get through: no engine could be had, or the weights failed
        # their checks. With generations running, their retries replace
        # engines too and the next sync waits for them; else the run ends.
        if not pipeline.sync_failed(now):
            raise
        get_run_logger().warning(
            "sync of iteration %d's version failed (%s); retried later", made_by, exc
        )
        return False
    pipeline.sync_done(synced.version, now)
    ledger.syncs[synced.version - 1] = synced
    return True


def first_done(futures: list[PrefectConcurrentFuture]) -> PrefectConcurrentFuture:
    """The first of `futures` to finish, waited for in short slices: the CLI's
    stop (flows/lifetime.py) arrives in this thread as an asynchronous
    exception, raised only when the thread runs Python code. Not Prefect's
    `as_completed(timeout=...)`: its thread timeout is itself an asynchronous
    exception, which replaces a pending stop."""
    by_wrapped = {future.wrapped_future: future for future in futures}
    while True:
        done, _ = concurrent.futures.wait(
            by_wrapped, timeout=STOP_CHECK_S, return_when=concurrent.futures.FIRST_COMPLETED
        )
        if done:
            return by_wrapped[next(iter(done))]


def iteration_plan(
    params: RolloutParams,
    run_dir: Path,
    iteration: int,
    prompts: int,
    *,
    on_policy: bool,
    agent: AgentPlan | None = None,
) -> GenerationPlan | PartialPlan:
    """What the iteration's generation task gets: under `partial` the plan
    with the groups kept generating and the wait bound."""
    plan = generation_plan(params, run_dir, iteration, on_policy=on_policy, agent=agent)
    training = params.training
    if not training.schedule_rule.partial:
        return plan
    groups = in_flight_groups(prompts, training.partial_in_flight)
    return PartialPlan(
        plan,
        groups,
        max_wait=training.max_staleness,
        keep_generating=training.partial_keep_generating,
        # The last iteration has no next one to start.
        start_next=training.partial_start_next and iteration + 1 < training.iterations,
    )


def generation_plan(
    params: RolloutParams,
    run_dir: Path,
    iteration: int,
    *,
    on_policy: bool = False,
    agent: AgentPlan | None = None,
) -> GenerationPlan:
    sampling = params.sampling.request()
    if on_policy and sampling.logprobs is None:
        # The policy weighs each token by its own logprob over the engine's
        # (truncated importance sampling) and reports their mismatch.
        sampling = sampling.model_copy(update={"logprobs": 0})
    return GenerationPlan(
        run_dir=str(run_dir),
        iteration=iteration,
        sampling=sampling,
        base_seed=params.sampling.seed,
        output=params.output,
        cluster=params.cluster,
        reward_timeout_s=params.training.reward_timeout_s,
        agent=agent,
        max_refill_rounds=(
            params.training.max_refill_rounds if params.training.dynamic_sampling else None
        ),
    )
