"""The engine pool (tasks/pool.py): what it says when placement holds the
engines back."""

from __future__ import annotations

import pytest
from ray.util.placement_group import placement_group, remove_placement_group

from engines.placement import EnginePlacement
from engines.vllm_engine import EngineSet
from tasks.pool import EnginePool


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
