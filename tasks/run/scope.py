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

from dataclasses import dataclass

import ray

from engines import destroy_engines, naming


@dataclass(frozen=True)
class RunScope:
    run_id: str
    attempt: int

    @property
    def namespace(self) -> str:
        return naming.run_namespace(self.run_id)

    @property
    def name_prefix(self) -> str:
        return naming.run_prefix(self.run_id, self.attempt)

    @property
    def policy_name(self) -> str:
        return naming.policy_name(self.name_prefix)

    @property
    def reward_name(self) -> str:
        return naming.reward_name(self.name_prefix)


def leftover_prefixes(run_id: str) -> set[str]:
    """Name prefixes of every attempt of the run that still has an engine
    actor or a placement group on the cluster."""
    prefix = naming.run_prefix_pattern(run_id)
    actor_name = naming.engine_name_pattern(prefix)
    group_name = naming.placement_group_pattern(prefix)
    found = set()
    for actor in ray.util.list_named_actors(all_namespaces=True):
        match = actor_name.match(actor["name"])
        if match and actor["namespace"] == naming.run_namespace(run_id):
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
    namespace = naming.run_namespace(run_id)
    prefixes = sorted(leftover_prefixes(run_id))
    for prefix in prefixes:
        destroy_engines(name_prefix=prefix, namespace=namespace, timeout_s=timeout_s)
    policy = naming.run_actor_pattern(naming.run_prefix_pattern(run_id))
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == namespace and policy.match(actor["name"]):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            except ValueError:  # already gone
                continue
            prefixes.append(actor["name"])
    return prefixes
