"""The engine pool (tasks/run/pool.py): what it says when placement holds the
engines back, and how generation tasks running side by side replace an
engine: one at a time, the replacement serving only once it is synced."""

from __future__ import annotations

import logging
import threading

import pytest
from ray.util.placement_group import placement_group, remove_placement_group

from engines import EngineSet
from engines.errors import EngineDeadError, EngineTimeoutError
from engines.lifecycle.placement import EnginePlacement
from tasks.run import pool as pool_module
from tasks.run.pool import EnginePool

LOGGER = logging.getLogger(__name__)


def pool_on(group) -> EnginePool:
    placement = EnginePlacement(group, bundles=[], uses_gpu=False, owns_group=True)
    engines = EngineSet(
        [], configs=[], name_prefix="rf-test", namespace="t", backend="hf", placement=placement
    )
    return EnginePool(engines)


@pytest.mark.parametrize("cpus", [1, 10_000])
def test_placement_problem_only_while_the_group_waits_for_room(ray_local, cpus):
    group = placement_group([{"CPU": cpus}], name=f"rf-test-pool-{cpus}")
    try:
        if cpus == 1:
            ray_local.get(group.ready(), timeout=60)
            assert pool_on(group).placement_problem() is None
        else:  # more than the cluster has: it stays PENDING
            problem = pool_on(group).placement_problem()
            assert "placement group is PENDING" in problem
            assert "{'CPU': 10000.0}" in problem
    finally:
        remove_placement_group(group)


class FakeEngines:
    """Stands in for an `EngineSet`: two engine names; replacing one (the
    patched `replace_engine`), restarting it (`restart_engine`, which
    succeeds when `restartable`) or adopting it in a prepared actor
    (`adopt_prepared`, which finds one when `prepared`) only counts."""

    names = ["rf-test-0", "rf-test-1"]

    def __init__(self) -> None:
        self.replaced: list[int] = []
        self.restarted: list[int] = []
        self.restartable = False
        self.adopted: list[int] = []
        self.prepared = False

    def restart(self, index: int) -> bool:
        self.restarted.append(index)
        return self.restartable

    def adopt(self, index: int) -> object | None:
        self.adopted.append(index)
        return object() if self.prepared else None

    def __len__(self) -> int:
        return len(self.names)


@pytest.fixture
def fake_pool(monkeypatch) -> EnginePool:
    monkeypatch.setattr(pool_module, "swap_in_spare", lambda engines, index, timeout_s: None)
    monkeypatch.setattr(pool_module, "adopt_prepared", lambda engines, index: engines.adopt(index))
    monkeypatch.setattr(
        pool_module, "replace_engine", lambda engines, index: engines.replaced.append(index)
    )
    monkeypatch.setattr(
        pool_module, "restart_engine", lambda engines, index: engines.restart(index)
    )
    pool = EnginePool(FakeEngines())
    pool.mark_failed(1, EngineDeadError("killed", "rf-test-1"))
    return pool


def test_a_replacement_gets_no_work_until_it_serves(fake_pool):
    assert fake_pool.live() == [0]
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5) as replaced:
        assert replaced == [1] and 1 not in fake_pool.failed
        assert fake_pool.live() == [0]  # up or synced: not yet
    assert fake_pool.live() == [0, 1]
    assert fake_pool.stats[1].restarts == 1 and fake_pool.stats[1].replacement_s is not None


def test_one_task_replaces_the_other_waits_then_finds_nothing(fake_pool):
    entered, release = threading.Event(), threading.Event()
    found: list[list[int]] = []

    def replace(wait_s: float) -> None:
        with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=wait_s) as replaced:
            found.append(replaced)
            entered.set()
            assert release.wait(30)

    first = threading.Thread(target=replace, args=(30,))
    first.start()
    assert entered.wait(30)
    # While the first one holds it, a second times out at its deadline...
    with pytest.raises(EngineTimeoutError, match="still replacing engines after 0.05s"):
        replace(0.05)
    second = threading.Thread(target=replace, args=(30,))
    second.start()  # ...or, with a longer one, waits
    release.set()
    first.join(30)
    second.join(30)
    assert found == [[1], []]  # the second found the engine replaced
    assert fake_pool.engines.replaced == [1]
    assert fake_pool.live() == [0, 1]


def test_a_replacement_that_fails_is_replaced_again(fake_pool):
    with pytest.raises(EngineTimeoutError):
        with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5):
            raise EngineTimeoutError("not ready within 5s", "rf-test-1")
    assert 1 in fake_pool.failed and not fake_pool.replacing_since
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5) as replaced:
        assert replaced == [1]  # the lock was released; the next try replaces it
    assert fake_pool.engines.replaced == [1, 1] and fake_pool.live() == [0, 1]


def test_a_failure_of_the_replaced_engine_leaves_its_replacement_alone(fake_pool):
    """Two tasks had work on engine 1 when it died; the first one's retry
    replaced it. The second one's failure, seen late, names the old engine."""
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5):
        pass
    fake_pool.mark_failed(1, EngineDeadError("killed", "rf-test-1"), restarts=0)
    assert fake_pool.live() == [0, 1] and fake_pool.stats[1].failures == 1
    fake_pool.mark_failed(1, EngineDeadError("killed again", "rf-test-1"), restarts=1)
    assert fake_pool.live() == [0]


def test_a_dead_engine_restarts_in_its_actor_when_the_actor_takes_it(fake_pool):
    fake_pool.engines.restartable = True
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5) as replaced:
        assert replaced == [1]
    assert fake_pool.engines.restarted == [1] and fake_pool.engines.replaced == []
    assert fake_pool.stats[1].replaced_by == "restart"


def test_an_engine_whose_actor_cannot_restart_it_gets_a_new_actor(fake_pool):
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5):
        pass
    assert fake_pool.engines.restarted == [1] and fake_pool.engines.replaced == [1]
    assert fake_pool.stats[1].replaced_by == "new"


def test_a_lost_actor_goes_to_a_prepared_actor_before_a_new_one(fake_pool):
    fake_pool.engines.prepared = True
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5):
        pass
    assert fake_pool.engines.restarted == [1] and fake_pool.engines.adopted == [1]
    assert fake_pool.engines.replaced == []
    assert fake_pool.stats[1].replaced_by == "prepared"


def test_a_hung_engine_is_not_restarted_in_its_actor(fake_pool):
    """A hang may hold the actor's own threads (an RPC cannot be interrupted):
    only a new actor is sure to start clean."""
    fake_pool.engines.restartable = True
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5):
        pass
    fake_pool.mark_failed(1, EngineTimeoutError("no answer in 5s", "rf-test-1"))
    with fake_pool.replacement(LOGGER, timeout_s=5, wait_s=5):
        pass
    assert fake_pool.engines.restarted == [1] and fake_pool.engines.replaced == [1]
    assert fake_pool.stats[1].replaced_by == "new"
