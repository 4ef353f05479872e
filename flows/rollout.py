"""The rollout flow: provision the cluster -> create engines -> readiness
checks -> generate rollouts (-> weight sync, between iterations) -> tear down.

Run it with `rolloutflow` (flows/cli.py, the command line; also `python -m
flows.cli`), or as a deployment (prefect.yaml names `rollout` here). Cleanup
is layered: the body's `finally` tears down what it created, and the hooks
sweep the run's engines by name, from whatever process they run in.

Beside the body: the iterations (flows/iterations.py), what the run starts
beside its engines (flows/side_actors.py) and its summary (flows/summary.py).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic.json_schema import SkipJsonSchema

from agents.loading import check_func_path, load_agent
from engines import EngineSetSpec, Placement, PlacementMode
from flows.hooks import sweep_engines
from flows.iterations import Ledger, run_iterations
from flows.params import RolloutParams
from flows.side_actors import SideActors
from flows.summary import RunSummary, summarize
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
from tasks.run.artifacts import publish_engine_table, publish_training_table
from tasks.run.loggers import check_logger, open_logger
from tasks.run.pool import EnginePool
from tasks.run.progress import RunProgress
from tasks.run.prompts import Prompts
from tasks.run.scope import RunScope
from tasks.run.shards import prepare_run_dir, set_aside_iterations
from training.rewards import absolute, load_reward, start_reward_scorer


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
    if params.agents.agent:
        load_agent(params.agents.agent)
    if params.agents.agent_func_path:
        check_func_path(params.agents.agent_func_path)
    check_logger(params.output.logger)


def engine_set(params: RolloutParams, model: str, backend: str) -> EngineSetSpec:
    """The engines a run of `params` starts (the flow, or the CLI early)."""
    with_trainer = params.training.colocate
    # An agent's sessions reach the engines over HTTP, through the router.
    served = {"openai_api": True} if params.agents.agent else {}
    return engine_spec(
        params.engines,
        pretrain=model,
        backend=backend,
        seed=params.sampling.seed,
        placement=Placement(PlacementMode.WITH_TRAINER) if with_trainer else Placement(),
        **served,
    )


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
    on_policy = params.on_policy
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
            side.close_agents()
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
    on_policy = params.on_policy
    # The policy and the reward actor start while the engines start (after
    # them: the engines' placement group is reserved first), and iteration
    # 0's generation does not wait for the policy. A policy on the engines'
    # GPU loads its model once they are up, its memory would change under
    # their KV cache sizing (training.policy_actor.loading_after); its
    # worker and imports run meanwhile, or the engines would have finished
    # iteration 0's groups and idle through its first step.
    if on_policy:
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
    agent = side.agent_plan(pool)
    with frozen_heap():
        looped = time.monotonic()
        with RunProgress() as progress:
            waited = run_iterations(
                params, run_dir, pool, prompts, progress, side.policy_up, side.scorer, ledger, agent
            )
        return time.monotonic() - looped - waited


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The iterations with what this process holds by then (the modules of
    torch, transformers, Prefect and Ray: over half a million objects) out
    of Python's full collections, as vLLM's engine freezes its own heap
    (`freeze_gc_heap`): a full collection walks every object with the GIL
    held, so each stalled the flow's threads (the tasks, the partial
    runner) for far longer than the garbage of an iteration takes to
    collect (figures: docs/history/benchmarks-diary.md). Unfrozen after,
    so a process that runs many flows (a test session) still collects what
    one run left. No collection before the freeze (vLLM's, frozen for its
    process's life, has one): it would add a full walk to every run's
    start, and what garbage is frozen is collected once the run unfreezes."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


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
        "agent": params.agents.agent,
        "agent_func_path": params.agents.agent_func_path,
        "reward_style": params.training.reward_style,
        "train": params.training.train,
        "learning_rate": params.training.learning_rate,
        "compute_dtype": params.training.compute_dtype,
    }
