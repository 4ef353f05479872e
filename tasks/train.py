"""Prefect tasks of the trainer: start the policy actor, and one training
step on an iteration's rollouts (whose rows carry their rewards).

Handles pass between tasks unhashed and unpersisted (`NO_CACHE`,
`persist_result=False`); a step's result is the policy's `StepReport`.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.client import get
from tasks.shards import read_rows
from training.config import PolicyConfig
from training.policy import create_policy_actor
from training.rollouts import groups_from_rows
from training.trainer import StepReport


@task(cache_policy=NO_CACHE, persist_result=False)
def start_policy(
    config: PolicyConfig | dict[str, Any],
    *,
    name: str | None = None,
    namespace: str | None = None,
    num_gpus: float = 0,
    ready_timeout_s: float = 600.0,
) -> Any:
    """Start the reference policy actor and wait until its model is loaded."""
    logger = get_run_logger()
    config = PolicyConfig.model_validate(config)
    started = time.monotonic()
    policy = create_policy_actor(config, name=name, namespace=namespace, num_gpus=num_gpus)
    try:
        state = get(policy.health.remote(), ready_timeout_s, "policy")
    except BaseException:
        ray.kill(policy, no_restart=True)
        raise
    logger.info("policy up in %.1fs: %s", time.monotonic() - started, state)
    return policy


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="train-iter-{iteration}")
def train_on_rollouts(
    policy: Any,
    rollout_dir: str,
    *,
    iteration: int,
    timeout_s: float = 600.0,
) -> StepReport:
    """One policy step on the scored rollouts in `rollout_dir`."""
    logger = get_run_logger()
    rows = read_rows(rollout_dir)
    if not rows:
        raise ValueError(f"no rollouts in {rollout_dir}")
    groups = groups_from_rows(rows)
    step = get(policy.train_step.remote([g.model_dump() for g in groups]), timeout_s, "policy")
    mismatch = (
        "" if step.logprob_mismatch is None else f", logprob mismatch {step.logprob_mismatch:.4f}"
    )
    logger.info(
        "iteration %d: mean reward %.4f over %d samples (staleness <= %d%s); policy at v%d",
        iteration,
        step.mean_reward,
        step.samples,
        step.staleness_max,
        mismatch,
        step.version,
    )
    return step
