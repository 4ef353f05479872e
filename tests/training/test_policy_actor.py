"""The policy as a Ray actor: one started before the engines on its GPU are
up loads its model only after them, its imports done while it waited."""

from __future__ import annotations

import asyncio

import pytest
import ray
from waiting import SETUP_TIMEOUT_S

from engines.client import get
from training.config import PolicyConfig
from training.policy_actor import create_policy_actor


@ray.remote(num_cpus=0)
class Gate:
    """Stands for the engines: `passed()` is done once `open()` was called."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def passed(self) -> None:
        await self.opened.wait()

    async def open(self) -> None:
        self.opened.set()


@pytest.mark.usefixtures("ray_local")
def test_a_policy_started_after_refs_loads_once_they_are_done(tiny_model):
    gate = Gate.remote()
    policy = create_policy_actor(
        PolicyConfig(pretrain=tiny_model), after=[gate.passed.remote()], after_timeout_s=120
    )
    try:
        health = policy.health.remote()
        # Held at the gate: the model does not load, whatever the wait.
        ready, _ = ray.wait([health], timeout=3.0)
        assert not ready
        get(gate.open.remote(), 30, "gate")
        assert get(health, SETUP_TIMEOUT_S, "policy")["weight_version"] == 0
        startup = get(policy.startup_report.remote(), 30, "policy")
        # (How much of the hold went to the wait depends on the worker's start.)
        assert startup.turn_s > 0.0 and startup.imports_s > 0.0
        assert policy._ray_actor_creation_function_descriptor.class_name == "ReferencePolicy"
    finally:
        ray.kill(policy, no_restart=True)
        ray.kill(gate, no_restart=True)


@pytest.mark.usefixtures("ray_local")
def test_a_policy_without_refs_waits_for_nothing(tiny_model):
    policy = create_policy_actor(PolicyConfig(pretrain=tiny_model))
    try:
        get(policy.health.remote(), SETUP_TIMEOUT_S, "policy")
        assert get(policy.startup_report.remote(), 30, "policy").turn_s == 0.0
    finally:
        ray.kill(policy, no_restart=True)
