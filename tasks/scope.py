"""Names of a flow run's Ray objects, and the sweep that finds and removes
them by name alone.

Everything is derived from the flow run id, so any process connected to the
cluster can clean up after a run: the flow's own `finally`, a failure hook in
the flow process, or `on_cancellation` / `on_crashed` run by a worker in
another process that holds no handle. Each attempt of a run (a UI "Retry"
starts another, with the same run id) has its own name prefix, so it never
collides with what an earlier attempt may have left behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import ray

from engines import destroy_engines


@dataclass(frozen=True)
class RunScope:
    run_id: str
    attempt: int

    @property
    def namespace(self) -> str:
        return run_namespace(self.run_id)

    @property
    def name_prefix(self) -> str:
        # Placement group names are global to the cluster, hence the run id
        # in the prefix and not only in the namespace.
        return f"rf-{self.run_id}-a{self.attempt}"

    @property
    def policy_name(self) -> str:
        return f"{self.name_prefix}-policy"


def run_namespace(run_id: str) -> str:
    return f"rolloutflow-{run_id}"


def leftover_prefixes(run_id: str) -> set[str]:
    """Name prefixes of every attempt of the run that still has an engine
    actor or a placement group on the cluster."""
    prefix = rf"rf-{re.escape(run_id)}-a\d+"
    actor_name = re.compile(rf"^({prefix})-\d+$")
    group_name = re.compile(rf"^({prefix})-pg$")
    found = set()
    for actor in ray.util.list_named_actors(all_namespaces=True):
        match = actor_name.match(actor["name"])
        if match and actor["namespace"] == run_namespace(run_id):
            found.add(match.group(1))
    for info in ray.util.placement_group_table().values():
        match = group_name.match(info.get("name") or "")
        if match and info.get("state") != "REMOVED":
            found.add(match.group(1))
    return found


def sweep_run(run_id: str, timeout_s: float = 30.0) -> list[str]:
    """Kill the run's engines, policy and reward actors and remove its placement
    groups, every attempt's; idempotent. Returns the prefixes that had
    something left."""
    prefixes = sorted(leftover_prefixes(run_id))
    for prefix in prefixes:
        destroy_engines(name_prefix=prefix, namespace=run_namespace(run_id), timeout_s=timeout_s)
    policy = re.compile(rf"^rf-{re.escape(run_id)}-a\d+-(policy|reward)$")
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == run_namespace(run_id) and policy.match(actor["name"]):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            except ValueError:  # already gone
                continue
            prefixes.append(actor["name"])
    return prefixes
