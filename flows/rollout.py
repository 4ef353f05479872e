"""The rollout flow: provision the cluster -> create engines -> readiness
checks -> generate rollouts (-> weight sync, between iterations) -> tear down.

Run it with `python -m flows.cli` (local), or as a deployment (prefect.yaml).
Cleanup is layered: the body's `finally` tears down what it created, and the
hooks sweep the run's engines by name, from whatever process they run in.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.hooks import sweep_engines
from flows.params import RolloutParams
from tasks.artifacts import publish_engine_table, publish_summary, start_progress
from tasks.cluster import provision_cluster
from tasks.engines import create_engines, resolve_model, teardown, wait_until_ready
from tasks.generate import GenerationPlan, IterationReport, generate_rollouts
from tasks.pool import EnginePool
from tasks.prompts import load_prompts
from tasks.scope import RunScope
from tasks.shards import plan_shards, prepare_run_dir, write_atomically

SUMMARY_FILE = "summary.json"


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
    iterations: list[IterationReport]


@flow(
    name="rollout",
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
    # Input first: bad prompts or a clashing output directory fail the run
    # before anything is created.
    prompts = load_prompts(params.prompts_path, params.prompt_field)
    model = resolve_model(params.model)
    run_dir = prepare_run_dir(
        Path(params.output_dir) / scope.run_id, manifest(params, prompts, model)
    )
    cluster = provision_cluster(
        scope=scope,
        address=params.address,
        local_num_cpus=params.local_num_cpus,
        backend=params.backend,
        num_engines=params.num_engines,
        tensor_parallel_size=params.tensor_parallel_size,
    )
    pool: EnginePool | None = None
    reports: list[IterationReport] = []
    try:
        pool = create_engines(
            scope=scope,
            cluster=cluster,
            model=model,
            num_engines=params.num_engines,
            tensor_parallel_size=params.tensor_parallel_size,
            max_len=params.max_len,
            gpu_memory_utilization=params.gpu_memory_utilization,
            seed=params.seed,
        )
        wait_until_ready.with_options(retries=params.engine_retries)(pool, params.ready_timeout_s)
        generate = generate_rollouts.with_options(retries=params.engine_retries)
        for iteration in range(params.iterations):
            plan = generation_plan(params, run_dir, iteration)
            progress = start_progress(iteration, 0, len(plan_shards(len(prompts), plan.shard_size)))
            reports.append(generate(pool, prompts, plan, progress))
            # Weight sync (issue 4) goes here: score and train on
            # reports[-1].directory, then sync the new weights into `pool`,
            # so that iteration + 1 samples from them. Without a trainer each
            # iteration is one more round of rollouts (with new seeds).
        summary = RunSummary(
            run_id=scope.run_id,
            attempt=scope.attempt,
            output_dir=str(run_dir),
            rows=sum(report.rows for report in reports),
            generate_calls=sum(stats.generate_calls for stats in pool.stats),
            seconds=round(time.monotonic() - began, 2),
            iterations=reports,
        )
        write_atomically(run_dir / SUMMARY_FILE, [json.dumps(asdict(summary), indent=2)])
        publish_summary(summary_markdown(summary, pool))
        logger.info("%d rollouts written to %s", summary.rows, run_dir)
        return summary
    finally:
        try:
            teardown(pool, scope, cluster)
        finally:
            if pool is not None:  # also after a failure: it shows which engine failed
                publish_engine_table(pool)


def generation_plan(params: RolloutParams, run_dir: Path, iteration: int) -> GenerationPlan:
    return GenerationPlan(
        run_dir=str(run_dir),
        iteration=iteration,
        sampling=params.sampling(),
        base_seed=params.seed,
        shard_size=params.shard_size,
        output_format=params.output_format,
        shards_per_engine=params.shards_per_engine,
        request_timeout_s=params.request_timeout_s,
        ready_timeout_s=params.ready_timeout_s,
    )


def manifest(params: RolloutParams, prompts, model: str) -> dict:
    """What the shards' content depends on: a rerun may reuse shards only if
    all of it is unchanged (engine count, timeouts and the like do not matter)."""
    return {
        "prompts_sha256": prompts.sha256,
        "prompt_field": params.prompt_field,
        "model": model,
        "sampling": params.sampling().model_dump(),
        "seed": params.seed,
        "shard_size": params.shard_size,
        "output_format": params.output_format,
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
