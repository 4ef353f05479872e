"""Prefect tasks of the trainer: start the policy actor, and one training
step on an iteration's rollouts (whose rows carry their rewards).

Handles pass between tasks unhashed and unpersisted (`NO_CACHE`,
`persist_result=False`); results are plain metrics dicts for the run's table.
"""

from __future__ import annotations

import statistics
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


@task(cache_policy=NO_CACHE, persist_result=False)
def train_on_rollouts(
    policy: Any,
    rollout_dir: str,
    *,
    iteration: int,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """One policy step on the scored rollouts in `rollout_dir`. Returns the
    iteration's metrics."""
    logger = get_run_logger()
    rows = read_rows(rollout_dir)
    if not rows:
        raise ValueError(f"no rollouts in {rollout_dir}")
    groups = groups_from_rows(rows)
    metrics = get(policy.train_step.remote([g.model_dump() for g in groups]), timeout_s, "policy")
    rewards = [r for group in groups for r in group.rewards]
    result = {"iteration": iteration, **metrics, "reward_std": statistics.pstdev(rewards)}
    logger.info(
        "iteration %d: mean reward %.4f over %d samples; policy now at version %d",
        iteration,
        result["mean_reward"],
        result["samples"],
        result["version"],
    )
    return result
