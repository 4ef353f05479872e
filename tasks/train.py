"""Prefect tasks of the trainer: wait for the policy actor to come up, and
one training step on an iteration's rollouts (whose rows carry their rewards).

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
from tasks.run.shards import read_rows
from training.rollouts import groups_from_rows
from training.trainer import StepReport


@task(cache_policy=NO_CACHE, persist_result=False)
def wait_for_policy(policy: Any, *, ready_timeout_s: float = 600.0) -> Any:
    """Wait until the policy actor (from `create_policy_actor`, which returns
    at once: the model loads in the actor) is up; returns its handle. One
    that fails to come up is killed."""
    logger = get_run_logger()
    started = time.monotonic()
    try:
        state = get(policy.health.remote(), ready_timeout_s, "policy")
    except BaseException:
        ray.kill(policy, no_restart=True)
        raise
    logger.info("policy up after %.1fs more: %s", time.monotonic() - started, state)
    logger.info("policy start-up: %s", get(policy.startup_report.remote(), 60.0, "policy"))
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
    groups = groups_from_rows(trained_rows(rows))
    step = get(policy.train_step.remote([g.model_dump() for g in groups]), timeout_s, "policy")
    mismatch = (
        "" if step.logprob_mismatch is None else f", logprob mismatch {step.logprob_mismatch:.4f}"
    )
    logger.info(
        "iteration %d: mean reward %.4f over %d samples (staleness <= %d%s); "
        "step %.2f s over %d tokens; policy at v%d",
        iteration,
        step.mean_reward,
        step.samples,
        step.staleness_max,
        mismatch,
        step.seconds,
        step.trained_tokens,
        step.version,
    )
    return step


def trained_rows(rows: list[dict]) -> list[dict]:
    """The rows a step trains on. Dynamic sampling: those of groups with
    learning signal; when no group has any (the refill rounds ran out), the
    iteration's own rows, so the step still makes its version."""
    kept = [row for row in rows if not row.get("filtered")]
    return kept or [row for row in rows if not row.get("refill_round")]
