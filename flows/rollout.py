"""The rollout flow: provision the cluster -> create engines -> readiness
checks -> generate rollouts (-> weight sync, between iterations) -> tear down.

Run it with `python -m flows.cli` (local), or as a deployment (prefect.yaml).
Cleanup is layered: the body's `finally` tears down what it created, and the
hooks sweep the run's engines by name, from whatever process they run in.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from prefect import flow, get_run_logger
from prefect.futures import PrefectConcurrentFuture
from prefect.runtime import flow_run

from engines.errors import EngineFailure
from engines.weight_sync import SyncReport, transport_for
from engines.weight_sync.errors import WeightSyncError
from flows.hooks import sweep_engines
from flows.params import RolloutParams
from flows.schedule import Pipeline
from tasks.artifacts import publish_engine_table, publish_summary, publish_training_table
from tasks.cluster import provision_cluster
from tasks.engines import (
    EngineRequest,
    create_engines,
    resolve_model,
    teardown,
    wait_until_ready,
)
from tasks.generate import GenerationPlan, IterationReport, PolicyLink, generate_rollouts
from tasks.loggers import MetricsLogger, check_logger, open_logger
from tasks.pool import EnginePool
from tasks.progress import RunProgress
from tasks.prompts import PromptFields, Prompts, load_prompts
from tasks.report import (
    CURVES_FILE,
    IterationMetrics,
    TrainingRow,
    curves_markdown,
    write_curves_png,
)
from tasks.scope import RunScope
from tasks.shards import prepare_run_dir, set_aside_iterations, write_atomically
from tasks.sync_weights import sync_weights
from tasks.train import train_on_rollouts, wait_for_policy
from training.config import PolicyConfig
from training.policy import create_policy_actor
from training.rewards import absolute as reward_path
from training.rewards import load_reward, start_reward_scorer
from training.trainer import StepReport

SUMMARY_FILE = "summary.json"
#: How long the iteration loop waits on its tasks before it looks again.
STOP_CHECK_S = 0.2


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    attempt: int
    output_dir: str
    rows: int
    #: Requests sent to engines by this attempt (shards written by an earlier
    #: attempt of the run are reused, not regenerated).
    generate_calls: int
    seconds: float
    #: Of which the iterations (generate, train, sync), after start-up.
    iterations_seconds: float
    iterations: list[IterationReport]
    #: On-policy runs: per iteration, the policy step and the sync after it.
    training: list[TrainingRow]
    #: Per iteration: what the curves show.
    metrics: list[IterationMetrics]
    #: The curves as a PNG (None when there is nothing to draw).
    curves: str | None


def run_name() -> str:
    """The flow run's name in the UI: model, engines and iterations, e.g.
    `qwen2.5-7b-x8-3it` (the default tiny model reads `tiny`)."""
    params = flow_run.parameters.get("params") or {}
    if not isinstance(params, dict):
        params = params.model_dump()
    defaults = RolloutParams()
    model = Path(params.get("model") or "tiny").name
    engines = params.get("num_engines", defaults.num_engines)
    return f"{model}-x{engines}-{params.get('iterations', defaults.iterations)}it"


def check_settings(params: RolloutParams) -> None:
    """The run's sampling fields, reward (a bad import path) and logger: the
    input checks besides the prompts'."""
    params.sampling()
    if params.reward:
        load_reward(params.reward, params.reward_style)
    check_logger(params.logger)


def engine_request(params: RolloutParams, model: str, backend: str) -> EngineRequest:
    """The engines a run of `params` starts (the flow, or the CLI early)."""
    return EngineRequest(
        model=model,
        backend=backend,
        num_engines=params.num_engines,
        tensor_parallel_size=params.tensor_parallel_size,
        max_len=params.max_len,
        gpu_memory_utilization=params.gpu_memory_utilization,
        seed=params.seed,
        engine_kwargs=params.engine_kwargs,
        spare_engines=params.spare_engines,
        colocate_trainer=params.colocate,
    )


def policy_placement(params: RolloutParams, pool: EnginePool, backend: str) -> dict[str, Any]:
    """The policy's Ray options: beside the engines on their GPU (colocate),
    else a GPU of its own on a GPU cluster."""
    if params.colocate:
        return pool.engines.placement.trainer_options()
    return {"num_gpus": 1 if backend == "vllm" else 0}


@flow(
    name="rollout",
    flow_run_name=run_name,
    on_failure=[sweep_engines],
    on_crashed=[sweep_engines],
    on_cancellation=[sweep_engines],
    persist_result=False,
)
def rollout(params: RolloutParams = RolloutParams()) -> RunSummary:  # noqa: B008 - frozen
    """Generate `n` rollouts per prompt with a set of engines on Ray and write
    them, in shards, under `<output_dir>/<flow run id>/`."""
    logger = get_run_logger()
    began = time.monotonic()
    scope = RunScope(run_id=str(flow_run.get_id()), attempt=flow_run.get_run_count())
    # Input first: bad prompts, sampling fields or reward, or a clashing
    # output directory fail the run before anything is created.
    check_settings(params)
    model = resolve_model(params.model)
    prompts = load_prompts(
        params.prompts_path, prompt_fields(params), model, params.apply_chat_template
    )
    run_dir = prepare_run_dir(
        Path(params.output_dir) / scope.run_id, manifest(params, prompts, model)
    )
    on_policy = params.on_policy
    if on_policy and (aside := set_aside_iterations(run_dir, scope.attempt)):
        logger.warning("on-policy run restarts its iterations; earlier rollouts moved to %s", aside)
    cluster = provision_cluster(
        scope=scope,
        address=params.address,
        local_num_cpus=params.local_num_cpus,
        backend=params.backend,
        num_engines=params.num_engines + params.spare_engines,
        tensor_parallel_size=params.tensor_parallel_size,
        with_policy=on_policy,
        colocate=params.colocate,
        runtime_env=params.runtime_env,
    )
    pool: EnginePool | None = None
    policy = None
    scorer = None
    training: list[TrainingRow] = []
    metrics: list[IterationMetrics] = []
    metrics_logger: MetricsLogger | None = None
    try:
        metrics_logger = open_logger(params.logger, run_dir, scope.run_id, params.model_dump())
        pool = create_engines(scope=scope, request=engine_request(params, model, cluster.backend))

        def start_policy():
            actor = create_policy_actor(
                policy_config(params, model, cluster.backend),
                name=scope.policy_name,
                namespace=scope.namespace,
                **policy_placement(params, pool, cluster.backend),
            )
            return actor, wait_for_policy.submit(actor, ready_timeout_s=params.ready_timeout_s)

        # The policy and the reward actor start while the engines start
        # (after them: the engines' placement group is reserved first), and
        # iteration 0's generation does not wait for the policy. A policy on
        # the engines' GPU starts once they are up: its memory would change
        # under their KV cache sizing (engines.base.wait_turn).
        policy_up = None
        if on_policy and not params.colocate:
            policy, policy_up = start_policy()
        if params.reward:
            scorer = start_reward_scorer(
                reward_path(params.reward),
                params.reward_style,
                name=scope.reward_name,
                namespace=scope.namespace,
            )
        wait_until_ready.with_options(retries=params.engine_retries)(pool, params.ready_timeout_s)
        if on_policy and params.colocate:
            policy, policy_up = start_policy()
        ledger = Ledger(training, metrics, metrics_logger)
        looped = time.monotonic()
        with RunProgress() as progress:
            run_iterations(params, run_dir, pool, prompts, progress, policy_up, scorer, ledger)
        looped_s = time.monotonic() - looped
        reports = [ledger.reports[i] for i in sorted(ledger.reports)]
        curves = write_curves_png(metrics, run_dir / CURVES_FILE)
        summary = RunSummary(
            run_id=scope.run_id,
            attempt=scope.attempt,
            output_dir=str(run_dir),
            rows=sum(report.rows for report in reports),
            generate_calls=sum(stats.generate_calls for stats in pool.stats),
            seconds=round(time.monotonic() - began, 2),
            iterations_seconds=round(looped_s, 2),
            iterations=reports,
            training=training,
            metrics=metrics,
            curves=str(curves) if curves else None,
        )
        write_atomically(run_dir / SUMMARY_FILE, [json.dumps(asdict(summary), indent=2)])
        publish_summary(summary_markdown(summary, pool) + "\n\n" + curves_markdown(metrics, curves))
        logger.info("%d rollouts written to %s", summary.rows, run_dir)
        return summary
    finally:
        if metrics_logger is not None:
            metrics_logger.close()
        try:
            if scorer is not None:
                ray.kill(scorer, no_restart=True)
            if pool is not None:
                # A task still running (a generation submitted beside the one
                # that failed, or under a stop) must not replace the engines
                # torn down next.
                pool.close()
            teardown(pool, scope, cluster, policy)
        finally:
            if pool is not None:  # also after a failure: it shows which engine failed
                publish_engine_table(pool)
            if training:
                publish_training_table(training)


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
) -> None:
    """Generate (-> train -> sync) every iteration, as `params.schedule`
    interleaves them (flows/schedule.py decides, this submits): Prefect task
    futures on the flow's task runner, so the UI shows the tasks side by side.

    `policy_up`: on an on-policy run, the future of the policy's start-up
    (its handle). Generation does not wait for it; training waits, and the
    first sync connects the policy to the engines."""
    logger = get_run_logger()
    pipeline = Pipeline(
        params.iterations, params.schedule, params.staleness_bound, trains=policy_up is not None
    )
    generate = generate_rollouts.with_options(retries=params.engine_retries)
    running: dict[PrefectConcurrentFuture, tuple[str, int]] = {}
    if policy_up is not None:
        running[policy_up] = ("policy", 0)
    policy = None  # the handle, once the policy is up
    # Set once a sync went through (the policy knows the engines): from then
    # on a replacement engine is synced to it before it serves.
    link = PolicyLink()
    pipeline.start(time.monotonic())
    while not pipeline.done:
        now = time.monotonic()
        if pipeline.should_sync():
            pipeline.sync_started(now)
            made_by = pipeline.trained - 1
            future = sync_weights.submit(
                policy, list(pool.engines), iteration=made_by, connect=link.handle is None
            )
            running[future] = ("sync", made_by)
        if policy is not None and (i := pipeline.next_training()) is not None:
            pipeline.training_started(i, now)
            future = train_on_rollouts.submit(policy, ledger.reports[i].directory, iteration=i)
            running[future] = ("train", i)
        while (i := pipeline.next_generation()) is not None:  # in_flight: several at once
            pipeline.generation_started(i, now)
            plan = generation_plan(params, run_dir, i, on_policy=policy_up is not None)
            bar = progress.iteration(i, len(prompts) * params.n)
            running[generate.submit(pool, prompts, plan, bar, link, scorer)] = ("generate", i)
        future = first_done(list(running))
        kind, i = running.pop(future)
        now = time.monotonic()
        if kind == "policy":
            policy = future.result()
        elif kind == "generate":
            ledger.reports[i] = future.result()
            pipeline.generation_done(i, now)
        elif kind == "train":
            ledger.steps[i] = step = future.result()
            pipeline.training_done(step.version, now)
        else:
            try:
                synced = future.result()
            except (EngineFailure, WeightSyncError) as exc:
                # An engine died under the sync: a running generation's
                # retry replaces it and syncs it (and the others) to the
                # policy's version; the next sync waits for those generations.
                if not pipeline.sync_failed(now):
                    raise
                logger.warning("sync of iteration %d's version failed (%s); retried later", i, exc)
            else:
                link.handle = policy
                pipeline.sync_done(synced.version, now)
                ledger.syncs[synced.version - 1] = synced
        ledger.close_iterations(pipeline)


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


def generation_plan(
    params: RolloutParams, run_dir: Path, iteration: int, *, on_policy: bool = False
) -> GenerationPlan:
    sampling = params.sampling()
    if on_policy and sampling.logprobs is None:
        # The policy weighs each token by its own logprob over the engine's
        # (truncated importance sampling) and reports their mismatch.
        sampling = sampling.model_copy(update={"logprobs": 0})
    return GenerationPlan(
        run_dir=str(run_dir),
        iteration=iteration,
        sampling=sampling,
        base_seed=params.seed,
        shard_size=params.shard_size,
        output_format=params.output_format,
        shards_per_engine=params.shards_per_engine,
        request_timeout_s=params.request_timeout_s,
        ready_timeout_s=params.ready_timeout_s,
        reward_timeout_s=params.reward_timeout_s,
    )


def prompt_fields(params: RolloutParams) -> PromptFields:
    return PromptFields(prompt=params.prompt_field, label=params.label_field, id=params.id_field)


def policy_config(params: RolloutParams, model: str, backend: str) -> PolicyConfig:
    """The reference policy for an on-policy run. The transport follows
    placement: NCCL from the policy's own GPU to vLLM engines, CUDA IPC on
    the GPU it shares with them (colocate), gloo on CPU."""
    on_gpu = backend == "vllm"
    return PolicyConfig(
        pretrain=model,
        learning_rate=params.learning_rate,
        micro_batch_tokens=params.micro_batch_tokens,
        seed=params.seed,
        device="cuda" if on_gpu else "cpu",
        transport=transport_for(colocated=params.colocate, device="cuda" if on_gpu else "cpu"),
        sync_backend="nccl" if on_gpu else "gloo",
        max_staleness=params.staleness_bound,
    )


def manifest(params: RolloutParams, prompts, model: str) -> dict:
    """What the shards' content depends on: a rerun may reuse shards only if
    all of it is unchanged (engine count, timeouts and the like do not matter)."""
    return {
        "prompts_sha256": prompts.sha256,
        "prompt_field": params.prompt_field,
        "label_field": params.label_field,
        "id_field": params.id_field,
        "apply_chat_template": params.apply_chat_template,
        "model": model,
        "sampling": params.sampling().model_dump(),
        "seed": params.seed,
        "shard_size": params.shard_size,
        "output_format": params.output_format,
        "reward": params.reward,
        "reward_style": params.reward_style,
        "train": params.train,
        "learning_rate": params.learning_rate,
    }


def summary_markdown(summary: RunSummary, pool: EnginePool) -> str:
    lines = [
        "# Rollout run",
        "",
        f"- output: `{summary.output_dir}`",
        f"- rows: {summary.rows} (attempt {summary.attempt}, {summary.seconds:.1f} s)",
        f"- engine requests this attempt: {summary.generate_calls}",
        f"- engine restarts: {sum(s.restarts for s in pool.stats)}",
        "",
        "| iteration | shards | reused | rows | seconds |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.iteration} | {r.shards} | {r.shards_skipped} | {r.rows} | {r.seconds:.1f} |"
        for r in summary.iterations
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    from flows.cli import main

    raise SystemExit(main())
