"""The weight sync of a pool with a dead engine (tasks/sync_weights.py):
the engines that died under the sync are found by their health and marked
failed, so the task's retry replaces them; the error names them by their
pool names. Engines and policy are fake Ray actors; the flow test
tests/flows/test_training_engine_death.py kills real engines."""

from __future__ import annotations

import logging

import pytest
import ray

import tasks.engines as engines_tasks
from engines.errors import EngineDeadError, EngineTimeoutError
from engines.weight_sync import SyncReport
from engines.weight_sync.errors import ChecksumMismatchError
from tasks.engines import replacing_failed
from tasks.run import pool as pool_module
from tasks.run.pool import EnginePool
from tasks.sync_weights import push_weights


@ray.remote(num_cpus=0)
class FakeEngine:
    async def health(self) -> dict:
        return {}


@ray.remote(num_cpus=0)
class FakePolicy:
    """Its sync fails as the coordinator's does (`error`), or reports version 1."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def sync_weights(self, engines: list, *, reconnect: bool = False) -> SyncReport:
        if self.error is not None:
            raise self.error
        return SyncReport(1, "broadcast", len(engines))


class FakeEngines(list):
    names = ["rf-test-0", "rf-test-1"]


@pytest.fixture
def pool(ray_local):
    handles = FakeEngines([FakeEngine.remote(), FakeEngine.remote()])
    ray.get([h.health.remote() for h in handles], timeout=60)
    yield EnginePool(handles)
    for handle in handles:
        ray.kill(handle)


def test_an_engine_dead_under_the_sync_is_marked_failed_and_named(pool):
    ray.kill(pool.engines[1])
    died = EngineDeadError("begin sync to version 1: engines ['engine 1'] died", "engine 1")
    policy = FakePolicy.remote(died)
    with pytest.raises(EngineDeadError, match=r"engines \['rf-test-1'\] died under the weight"):
        push_weights(policy, pool, 60, connect=False, reconnect=False)
    assert list(pool.failed) == [1] and pool.live() == [0]
    ray.kill(policy)


def test_a_sync_failure_with_every_engine_alive_is_raised_as_it_is(pool):
    policy = FakePolicy.remote(ChecksumMismatchError("rf-test-0: layer 3 differs"))
    with pytest.raises(ChecksumMismatchError, match="layer 3 differs"):
        push_weights(policy, pool, 60, connect=False, reconnect=False)
    assert not pool.failed
    ray.kill(policy)


def test_when_no_engine_can_be_had_the_error_names_it_and_why(monkeypatch):
    def cannot_replace(engines, index):
        raise EngineTimeoutError("rf-test-1 did not go away within 30s", "rf-test-1")

    monkeypatch.setattr(engines_tasks, "get_run_logger", lambda: logging.getLogger(__name__))
    monkeypatch.setattr(pool_module, "swap_in_spare", lambda engines, index, timeout_s: None)
    monkeypatch.setattr(pool_module, "adopt_prepared", lambda engines, index: None)
    monkeypatch.setattr(pool_module, "replace_engine", cannot_replace)
    pool = EnginePool(FakeEngines([None, None]))
    pool.mark_failed(1, EngineTimeoutError("hung", "rf-test-1"))
    expected = r"no engine could take the place of \['rf-test-1'\]: rf-test-1 did not go away"
    with pytest.raises(EngineTimeoutError, match=expected):
        with replacing_failed(pool, 1.0):
            pytest.fail("the body ran with no engine in the failed one's place")
    assert list(pool.failed) == [1]  # the next try replaces it again
