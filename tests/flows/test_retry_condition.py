"""Tasks retry on engine failures only: the retry condition, on real
Prefect task runs."""

from __future__ import annotations

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from engines import EngineDeadError, EngineTimeoutError, PromptTooLongError
from tasks.engines import retry_on_engine_failure

attempts: list[int] = []


@task(retries=2, retry_condition_fn=retry_on_engine_failure, cache_policy=NO_CACHE)
def fails_once(error: Exception) -> int:
    attempts.append(1)
    if len(attempts) == 1:
        raise error
    return len(attempts)


@flow
def run_fails_once(error: Exception) -> int:
    return fails_once(error)


@pytest.mark.parametrize(
    "error", [EngineDeadError("engine-0 died"), EngineTimeoutError("engine-0 hung")]
)
def test_engine_failures_are_retried(error):
    attempts.clear()
    assert run_fails_once(error) == 2


@pytest.mark.parametrize(
    "error", [PromptTooLongError("prompt 3 too long"), ValueError("bad input"), KeyError("bug")]
)
def test_other_errors_fail_at_once(error):
    attempts.clear()
    with pytest.raises(type(error)):
        run_fails_once(error)
    assert len(attempts) == 1
