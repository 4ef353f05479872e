"""Sweeping a run by name finds every attempt's actors and placement
groups, and nothing of other runs."""

from __future__ import annotations

import uuid

import ray
from ray.util.placement_group import placement_group
from waiting import wait_until

from tasks.run.scope import RunScope, leftover_prefixes, sweep_run


@ray.remote(num_cpus=0)
class Named:
    async def shutdown(self):
        return None


def leave_behind(scope: RunScope, engines: int) -> None:
    """What a killed attempt leaves: named engine actors and its placement group."""
    pg = placement_group([{"CPU": 0.01}], name=f"{scope.name_prefix}-pg")
    ray.get(pg.ready(), timeout=30)
    for i in range(engines):
        handle = Named.options(name=f"{scope.name_prefix}-{i}", namespace=scope.namespace).remote()
        ray.get(handle.shutdown.remote(), timeout=30)


def test_sweep_removes_every_attempt_and_spares_other_runs(ray_local):
    run, other = str(uuid.uuid4()), str(uuid.uuid4())
    leave_behind(RunScope(run, 1), engines=2)
    leave_behind(RunScope(run, 2), engines=1)
    leave_behind(RunScope(other, 1), engines=1)
    assert leftover_prefixes(run) == {f"rf-{run}-a1", f"rf-{run}-a2"}

    assert sweep_run(run) == [f"rf-{run}-a1", f"rf-{run}-a2"]
    assert leftover_prefixes(run) == set()
    assert sweep_run(run) == []  # idempotent

    assert leftover_prefixes(other) == {f"rf-{other}-a1"}
    sweep_run(other)


def test_sweep_ends_an_agent_runs_router_and_runners(ray_local):
    """A failure hook finds an agent run's router and runners by name."""
    from engines import naming

    scope = RunScope(str(uuid.uuid4()), 1)
    names = [naming.router_name(scope.name_prefix), naming.runner_name(scope.name_prefix, 0)]
    # Handles held, as the flow holds them: Ray ends an actor whose handles are all gone.
    handles = [Named.options(name=name, namespace=scope.namespace).remote() for name in names]
    ray.get([handle.shutdown.remote() for handle in handles], timeout=30)
    assert sorted(sweep_run(scope.run_id)) == sorted(names)

    def gone() -> bool:
        return not {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)} & {*names}

    wait_until(gone, 60, "the router and runner to end")
