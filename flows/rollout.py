"""The rollout flow: provision the cluster -> create engines -> readiness
checks -> generate rollouts (-> weight sync, between iterations) -> tear down.

Run it with `python -m flows.cli` (local), or as a deployment (prefect.yaml).
Cleanup is layered: the body's `finally` tears down what it created, and the
hooks sweep the run's engines by name, from whatever process they run in.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import ray
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic.json_schema import SkipJsonSchema

from agents.runner import AgentPlan, check_func_path, load_agent
from engines import EngineSetSpec, Placement, PlacementMode
from engines.weight_sync import transport_for
from flows.hooks import sweep_engines
from flows.iterations import Ledger, run_iterations
from flows.params import RolloutParams
from tasks.cluster import Cluster, provision_cluster
from tasks.engines import (
    EarlyEngines,
    create_engines,
    engine_spec,
    resolve_model,
    teardown,
    wait_until_ready,
)
from tasks.prompts import load_prompts
from tasks.run.artifacts import publish_engine_table, publish_summary, publish_training_table
from tasks.run.loggers import check_logger, open_logger
from tasks.run.plans import IterationReport
from tasks.run.pool import EnginePool
from tasks.run.progress import RunProgress
from tasks.run.prompts import Prompts
from tasks.run.report import (
    CURVES_FILE,
    IterationMetrics,
    TrainingRow,
    curves_markdown,
    write_curves_png,
)
from tasks.run.scope import RunScope
from tasks.run.shards import prepare_run_dir, set_aside_iterations, write_atomically
from tasks.train import wait_for_policy
from training.config import PolicyConfig
from training.policy import create_policy_actor, engine_dtype
from training.rewards import absolute, load_reward, start_reward_scorer

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
    #: Of which the iterations (generate, train, sync), after start-up (a
    #: colocated policy's, which starts after the engines, included).
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
    engines, training = params.get("engines") or {}, params.get("training") or {}
    defaults = RolloutParams()
    model = Path(engines.get("model") or "tiny").name
    count = engines.get("num_engines", defaults.engines.num_engines)
    return f"{model}-x{count}-{training.get('iterations', defaults.training.iterations)}it"


def check_settings(params: RolloutParams) -> None:
    """The run's sampling fields, reward (a bad import path) and logger: the
    input checks besides the prompts'."""
    params.sampling.request()
    if params.training.reward:
        load_reward(params.training.reward, params.training.reward_style)
    if params.training.agent:
        load_agent(params.training.agent)
    if params.training.agent_func_path:
        check_func_path(params.training.agent_func_path)
    check_logger(params.output.logger)


def engine_set(params: RolloutParams, model: str, backend: str) -> EngineSetSpec:
    """The engines a run of `params` starts (the flow, or the CLI early)."""
    with_trainer = params.training.colocate
    # An agent's sessions reach the engines over HTTP, through the router.
    served = {"openai_api": True} if params.training.agent else {}
    return engine_spec(
        params.engines,
        pretrain=model,
        backend=backend,
        seed=params.sampling.seed,
        placement=Placement(PlacementMode.WITH_TRAINER) if with_trainer else Placement(),
        **served,
    )


@dataclass
class SideActors:
    """What a run starts beside its engines: an on-policy run's policy (its
    handle, and the future of its start-up) and a reward run's scorer."""

    params: RolloutParams
    scope: RunScope
    model: str
    policy: Any = None
    policy_up: Any = None
    scorer: Any = None
    #: An agent run's router in front of the engines (agents/router/actor.py).
    router: Any = None

    def agent_plan(self, pool: EnginePool) -> AgentPlan | None:
        """An agent run's sessions: `--agent` through a router started here
        on the ready engines, `--agent-func-path` on the engines directly."""
        training = self.params.training
        if not training.agentic:
            return None
        plan = AgentPlan(
            agent=absolute(training.agent) if training.agent else None,
            func_path=check_func_path(training.agent_func_path)
            if training.agent_func_path
            else None,
            timeout_s=training.agent_timeout_s,
            model=self.model,
            sampling=self.params.sampling.request().model_copy(update={"n": 1}),
            max_length=self.params.engines.max_len,
        )
        if training.agent:
            # Imported here: only agent runs serve HTTP (fastapi, uvicorn).
            from agents.router.actor import start_router

            api_key = pool.engines.api_key
            self.router = start_router(list(pool.engines), api_key, routing="sticky")
            plan = replace(
                plan, router_url=self.router.url, api_key=api_key, router=self.router.actor
            )
        return plan

    def start_policy(self, pool: EnginePool, backend: str) -> None:
        """The policy goes beside the engines on their GPU (colocate), else
        on a GPU of its own on a GPU cluster."""
        params, scope = self.params, self.scope
        if params.training.colocate:
            placement = pool.engines.placement.trainer_options()
        else:
            placement = {"num_gpus": 1 if backend == "vllm" else 0}
        self.policy = create_policy_actor(
            policy_config(params, self.model, backend),
            name=scope.policy_name,
            namespace=scope.namespace,
            **placement,
        )
        timeout_s = params.cluster.ready_timeout_s
        self.policy_up = wait_for_policy.submit(self.policy, ready_timeout_s=timeout_s)


@flow(
    name="rollout",
    flow_run_name=run_name,
    on_failure=[sweep_engines],
    on_crashed=[sweep_engines],
    on_cancellation=[sweep_engines],
    persist_result=False,
)
def rollout(
    params: RolloutParams = RolloutParams(),  # noqa: B008 - frozen
    # The CLI's handoff, not a run setting: left out of the parameter schema,
    # so the deployment form and the server's schema check show only `params`.
    early: SkipJsonSchema[EarlyEngines | None] = None,
) -> RunSummary:
    """Generate `n` rollouts per prompt with a set of engines on Ray and write
    them, in shards, under `<output_dir>/<flow run id>/`. `early`: the
    engines the CLI started before the flow, taken when they are what the
    run asks for."""
    logger = get_run_logger()
    began = time.monotonic()
    scope = RunScope(run_id=str(flow_run.get_id()), attempt=flow_run.get_run_count())
    # Input first: bad prompts, sampling fields or reward, or a clashing
    # output directory fail the run before anything is created.
    check_settings(params)
    model = resolve_model(params.engines.model)
    prompts = load_prompts(params.data, model)
    run_dir = prepare_run_dir(
        Path(params.output.output_dir) / scope.run_id, manifest(params, prompts, model)
    )
    on_policy = params.training.on_policy
    if on_policy and (aside := set_aside_iterations(run_dir, scope.attempt)):
        logger.warning("on-policy run restarts its iterations; earlier rollouts moved to %s", aside)
    cluster = provision_cluster(
        scope=scope,
        cluster=params.cluster,
        engines=params.engines,
        with_policy=on_policy,
        colocate=params.training.colocate,
    )
    pool: EnginePool | None = None
    side = SideActors(params, scope, model)
    ledger = Ledger([], [])
    try:
        ledger.metrics_logger = open_logger(
            params.output.logger, run_dir, scope.run_id, params.model_dump()
        )
        spec = engine_set(params, model, cluster.backend)
        pool = create_engines(scope=scope, spec=spec, early=early)
        looped = start_and_iterate(params, cluster, pool, side, prompts, run_dir, ledger)
        summary = summarize(params, scope, pool, ledger, run_dir, began, looped)
        logger.info("%d rollouts written to %s", summary.rows, run_dir)
        return summary
    finally:
        if ledger.metrics_logger is not None:
            ledger.metrics_logger.close()
        try:
            if side.router is not None:
                side.router.close()
            if side.scorer is not None:
                ray.kill(side.scorer, no_restart=True)
            if pool is not None:
                # A task still running (a generation submitted beside the one
                # that failed, or under a stop) must not replace the engines
                # torn down next.
                pool.close()
            teardown(pool, scope, cluster, side.policy)
        finally:
            if pool is not None:  # also after a failure: it shows which engine failed
                publish_engine_table(pool)
            if ledger.training:
                publish_training_table(ledger.training)


def start_and_iterate(
    params: RolloutParams,
    cluster: Cluster,
    pool: EnginePool,
    side: SideActors,
    prompts: Prompts,
    run_dir: Path,
    ledger: Ledger,
) -> float:
    """Start the policy and the reward actor beside the engines, wait for
    the engines, run the iterations; returns the iterations' seconds."""
    on_policy, colocate = params.training.on_policy, params.training.colocate
    # The policy and the reward actor start while the engines start (after
    # them: the engines' placement group is reserved first), and iteration
    # 0's generation does not wait for the policy. A policy on the engines'
    # GPU starts once they are up: its memory would change under their KV
    # cache sizing (engines.base.wait_turn).
    if on_policy and not colocate:
        side.start_policy(pool, cluster.backend)
    if params.training.reward:
        side.scorer = start_reward_scorer(
            absolute(params.training.reward),
            params.training.reward_style,
            name=side.scope.reward_name,
            namespace=side.scope.namespace,
        )
    wait_until_ready.with_options(retries=params.cluster.engine_retries)(
        pool, params.cluster.ready_timeout_s
    )
    if on_policy and colocate:
        side.start_policy(pool, cluster.backend)
    agent = side.agent_plan(pool)
    looped = time.monotonic()
    with RunProgress() as progress:
        waited = run_iterations(
            params, run_dir, pool, prompts, progress, side.policy_up, side.scorer, ledger, agent
        )
    return time.monotonic() - looped - waited


def summarize(
    params: RolloutParams,
    scope: RunScope,
    pool: EnginePool,
    ledger: Ledger,
    run_dir: Path,
    began: float,
    looped_s: float,
) -> RunSummary:
    """The run's summary: written to summary.json and published as its artifact."""
    reports = [ledger.reports[i] for i in sorted(ledger.reports)]
    curves = write_curves_png(ledger.metrics, run_dir / CURVES_FILE)
    summary = RunSummary(
        run_id=scope.run_id,
        attempt=scope.attempt,
        output_dir=str(run_dir),
        rows=sum(report.rows for report in reports),
        generate_calls=sum(stats.generate_calls for stats in pool.stats),
        seconds=round(time.monotonic() - began, 2),
        iterations_seconds=round(looped_s, 2),
        iterations=reports,
        training=ledger.training,
        metrics=ledger.metrics,
        curves=str(curves) if curves else None,
    )
    write_atomically(run_dir / SUMMARY_FILE, [json.dumps(asdict(summary), indent=2)])
    markdown = summary_markdown(summary, pool) + "\n\n" + curves_markdown(ledger.metrics, curves)
    publish_summary(markdown)
    return summary


def policy_config(params: RolloutParams, model: str, backend: str) -> PolicyConfig:
    """The reference policy for an on-policy run. The transport follows
    placement: NCCL from the policy's own GPU to vLLM engines, CUDA IPC on
    the GPU it shares with them (colocate), gloo on CPU."""
    on_gpu = backend == "vllm"
    return PolicyConfig(
        pretrain=model,
        learning_rate=params.training.learning_rate,
        micro_batch_tokens=params.training.micro_batch_tokens,
        seed=params.sampling.seed,
        device="cuda" if on_gpu else "cpu",
        transport=transport_for(
            colocated=params.training.colocate, device="cuda" if on_gpu else "cpu"
        ),
        sync_backend="nccl" if on_gpu else "gloo",
        max_staleness=params.training.staleness_bound,
        probe=params.training.weight_sync_probe,
        sync_dtype=engine_dtype(model, backend, params.engines.engine_kwargs),
    )


def manifest(params: RolloutParams, prompts: Prompts, model: str) -> dict:
    """What the shards' content depends on: a rerun may reuse shards only if
    all of it is unchanged (engine count, timeouts and the like do not matter)."""
    return {
        "prompts_sha256": prompts.sha256,
        "prompt_field": params.data.prompt_field,
        "label_field": params.data.label_field,
        "id_field": params.data.id_field,
        "apply_chat_template": params.data.apply_chat_template,
        "model": model,
        "sampling": params.sampling.request().model_dump(),
        "seed": params.sampling.seed,
        "shard_size": params.output.shard_size,
        "output_format": params.output.output_format,
        "reward": params.training.reward,
        "agent": params.training.agent,
        "agent_func_path": params.training.agent_func_path,
        "reward_style": params.training.reward_style,
        "train": params.training.train,
        "learning_rate": params.training.learning_rate,
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
