"""Warm spares (engines/lifecycle/spares.py: `spare_engines`, `start_spare`,
`swap_in_spare`): reserved on the set's placement group, asleep once up,
woken in a dead engine's place, replaced by a new spare on the dead engine's
bundle, and removed with the set."""

from __future__ import annotations

import pytest
import ray

from engines import (
    EngineSleepingError,
    EngineSpecError,
    SamplingParams,
    create_vllm_engines,
    destroy_engines,
    swap_in_spare,
)
from engines.client import get
from engines.lifecycle.engine_set import existing_engine_names
from engines.naming import placement_group_name

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def live_groups(prefix: str) -> list[str]:
    return [
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info.get("name") == placement_group_name(prefix) and info.get("state") != "REMOVED"
    ]


def test_bad_spare_count_is_refused_before_anything_exists(ray_local, tiny_model):
    with pytest.raises(EngineSpecError, match="spare_engines must be an integer >= 0, got -1"):
        create_vllm_engines(1, tiny_model, 128, name_prefix="test-spare-bad", spare_engines=-1)
    assert existing_engine_names("test-spare-bad", "rolloutflow-tests") == []
    assert live_groups("test-spare-bad") == []


def test_spare_life_cycle(ray_local, tiny_model):
    prefix = "test-spare"
    engines = create_vllm_engines(
        1, tiny_model, 128, seed=5, name_prefix=prefix, backend="hf", spare_engines=1
    )
    try:
        # Reserved: its own bundle of the set's placement group, named past the engines.
        assert engines.names == [f"{prefix}-0"]
        (spare,) = engines.spares
        assert spare.config.name == f"{prefix}-1" and spare.config.seed == 6
        assert engines.placement.bundles == [[0], [1]]
        assert spare.config.bundle_indices == [1]
        # Asleep once up: it serves nothing until woken.
        get(spare.asleep, 120, spare.config.name)
        health = get(spare.handle.health.remote(), 30)
        assert health["sleeping"] == ["kv_cache", "weights"]
        with pytest.raises(EngineSleepingError):
            get(spare.handle.generate.remote([1, 2, 3], PARAMS), 30)

        # Engine 0 dies: the spare takes its place, awake, and a new spare
        # starts on the dead engine's bundle.
        dead = engines[0]
        ray.kill(dead, no_restart=True)
        assert swap_in_spare(engines, 0, timeout_s=60) is spare
        assert engines[0] is spare.handle and engines.names == [f"{prefix}-1"]
        assert engines.configs[0].bundle_indices == [1]
        out = get(engines[0].generate.remote([1, 2, 3], PARAMS), 60)
        assert len(out.outputs[0].token_ids) == 4 and out.engine == f"{prefix}-1"
        (successor,) = engines.spares
        assert successor.config.name == f"{prefix}-2"
        assert successor.config.bundle_indices == [0]
        get(successor.asleep, 120, successor.config.name)
        assert get(successor.handle.health.remote(), 30)["sleeping"] == ["kv_cache", "weights"]
        assert existing_engine_names(prefix, engines.namespace) == [f"{prefix}-1", f"{prefix}-2"]
    finally:
        destroy_engines(engines)
    # Cleaned up with the set: engines, spares and the placement group.
    assert existing_engine_names(prefix, engines.namespace) == []
    assert live_groups(prefix) == []


def test_a_spare_that_died_is_skipped(ray_local, tiny_model):
    engines = create_vllm_engines(
        1, tiny_model, 128, name_prefix="test-spare-dead", backend="hf", spare_engines=1
    )
    try:
        (spare,) = engines.spares
        ray.kill(spare.handle, no_restart=True)
        assert swap_in_spare(engines, 0, timeout_s=60) is None
        assert engines.spares == []
    finally:
        destroy_engines(engines)
