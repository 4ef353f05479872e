"""The names of the Ray objects engines and flow runs create, in one scheme.

An engine set has a name prefix: engine i is the named actor `<prefix>-<i>`,
its placement group `<prefix>-pg` (placement group names are global to the
cluster). A flow run lives in namespace `rolloutflow-<run id>`; attempt k of
it uses the prefix `rf-<run id>-a<k>`, its policy and reward actors
`<prefix>-policy` and `<prefix>-reward`, an agent run's router and runners
`<prefix>-router` and `<prefix>-runner<i>`, so a sweep finds every
attempt's objects from the run id alone.
"""

from __future__ import annotations

import re
import uuid

ENGINE_PREFIX = "rolloutflow-engine"


def unique_prefix() -> str:
    """A fresh prefix for an engine set given none: OpenRLHF creates
    evaluation engines beside rollout engines, without naming either."""
    return f"{ENGINE_PREFIX}-{uuid.uuid4().hex[:8]}"


def engine_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index}"


def placement_group_name(prefix: str) -> str:
    return f"{prefix}-pg"


def policy_name(prefix: str) -> str:
    return f"{prefix}-policy"


def reward_name(prefix: str) -> str:
    return f"{prefix}-reward"


def engine_name_pattern(prefix_pattern: str) -> re.Pattern:
    """Engine actor names under prefixes matching `prefix_pattern` (a regex);
    group 1 is the prefix."""
    return re.compile(rf"^({prefix_pattern})-\d+$")


def placement_group_pattern(prefix_pattern: str) -> re.Pattern:
    return re.compile(rf"^({prefix_pattern})-pg$")


def router_name(prefix: str) -> str:
    return f"{prefix}-router"


def runner_name(prefix: str, index: int) -> str:
    return f"{prefix}-runner{index}"


def run_actor_pattern(prefix_pattern: str) -> re.Pattern:
    """The policy, reward, router and agent runner actors under prefixes
    matching `prefix_pattern`."""
    return re.compile(rf"^({prefix_pattern})-(policy|reward|router|runner\d+)$")


def run_namespace(run_id: str) -> str:
    return f"rolloutflow-{run_id}"


def run_prefix(run_id: str, attempt: int) -> str:
    # The run id is in the prefix, not only in the namespace: placement group
    # names are global to the cluster.
    return f"rf-{run_id}-a{attempt}"


def run_prefix_pattern(run_id: str) -> str:
    """A regex matching the prefix of every attempt of the run."""
    return rf"rf-{re.escape(run_id)}-a\d+"
