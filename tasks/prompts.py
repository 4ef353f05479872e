"""The task that reads and checks a run's prompts (the reading itself:
tasks/run/prompts.py)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.run.params import DataParams
from tasks.run.prompts import Prompts, read_run_prompts


@task(cache_policy=NO_CACHE, persist_result=False)
def load_prompts(data: DataParams, model: str | None = None) -> Prompts:
    """Read and check every prompt before any engine is started."""
    prompts = read_run_prompts(data, model)
    get_run_logger().info("%d prompts from %s", len(prompts), prompts.path)
    return prompts
