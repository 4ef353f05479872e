"""Prepared actors (engines/lifecycle/prepared.py: `prepared_actors`,
`start_prepared`, `adopt_prepared`): started with the set, imports done and
no engine, holding no resources; one takes the place of an engine whose
actor was lost, holding that engine's resources on its bundle through an
anchor that ends with it; a new one is started; all removed with the set."""

from __future__ import annotations

import pytest
import ray
from waiting import wait_until

from engines import (
    EngineDeadError,
    EngineSpecError,
    SamplingParams,
    adopt_prepared,
    create_vllm_engines,
    destroy_engines,
)
from engines.client import get
from engines.lifecycle.engine_set import existing_engine_names

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def bundle_cpus_free(engines) -> float:
    """Of the CPU of the set's bundle 0, what no actor holds."""
    group = engines.placement.placement_group.id.hex()
    return ray.available_resources().get(f"CPU_group_0_{group}", 0.0)


def test_bad_counts_are_refused_before_anything_exists(ray_local, tiny_model):
    prefix = "test-prepared-bad"
    with pytest.raises(EngineSpecError, match="prepared_actors must be an integer >= 0, got -1"):
        create_vllm_engines(1, tiny_model, 128, name_prefix=prefix, prepared_actors=-1)
    with pytest.raises(EngineSpecError, match="prepared_actors=1 needs tensor_parallel_size=1"):
        create_vllm_engines(
            1, tiny_model, 128, name_prefix=prefix, prepared_actors=1, tensor_parallel_size=2
        )
    assert existing_engine_names(prefix, "rolloutflow-tests") == []


def test_prepared_actor_life_cycle(ray_local, tiny_model):
    prefix = "test-prepared"
    engines = create_vllm_engines(
        1, tiny_model, 128, seed=5, name_prefix=prefix, backend="hf", prepared_actors=1
    )
    try:
        (prepared,) = engines.prepared
        assert prepared.name == f"{prefix}-1" and prepared.bundle == 0
        # Up: its imports done, once the engine was up (not to slow its start).
        report = get(prepared.up, 120, prepared.name)
        assert [p.name for p in report.phases] == [
            "imports",
            "the engines up (a prepared actor's imports wait for them)",
            "torch and transformers imports",
        ]
        engine_up = get(engines[0].startup_report.remote(), 30).ready_at
        assert report.ready_at - report.phases[-1].seconds >= engine_up - 0.01
        assert bundle_cpus_free(engines) == 0.0  # the engine's, the prepared actor's none
        # The engine's actor is lost: the prepared actor takes its place with
        # its config (seed 5) under its own name, and a new one is prepared.
        ray.kill(engines[0], no_restart=True)
        assert adopt_prepared(engines, 0) is prepared
        assert engines[0] is prepared.handle and engines.names == [f"{prefix}-1"]
        assert engines.configs[0].seed == 5 and engines.configs[0].bundle_indices == [0]
        assert get(engines[0].ready.remote(), 120) == f"{prefix}-1"
        out = get(engines[0].generate.remote([1, 2, 3], PARAMS), 60)
        assert len(out.outputs[0].token_ids) == 4 and out.engine == f"{prefix}-1"
        report = get(engines[0].startup_report.remote(), 30)
        phases = [p.name for p in report.phases]
        assert phases[0] == "the lost engine's resources held (its bundle freed)"
        assert "torch and transformers imports" in phases  # again, and instant
        # Its anchor holds the lost engine's share of the bundle.
        assert bundle_cpus_free(engines) == 0.0
        (successor,) = engines.prepared
        assert successor.name == f"{prefix}-2"
        get(successor.up, 120, successor.name)
        # The adopter lost in turn: its anchor ends with it.
        ray.kill(engines[0], no_restart=True)
        wait_until(lambda: bundle_cpus_free(engines) == 1.0, 30, "its anchor to end with it")
        # A ready() that reaches it before its adopt() waits for the engine
        # (Ray may run an async actor's calls in another order than sent).
        early = successor.handle.ready.remote()
        assert adopt_prepared(engines, 0) is successor
        assert get(early, 120) == f"{prefix}-2"
    finally:
        destroy_engines(engines)
    assert existing_engine_names(prefix, engines.namespace) == []


def test_a_prepared_actor_that_failed_is_dropped(ray_local, tiny_model):
    engines = create_vllm_engines(
        1, tiny_model, 128, name_prefix="test-prepared-dead", backend="hf", prepared_actors=1
    )
    try:
        (prepared,) = engines.prepared
        ray.kill(prepared.handle, no_restart=True)
        with pytest.raises(Exception):  # noqa: B017 - Ray's actor-died error
            get(prepared.up, 30)
        assert adopt_prepared(engines, 0) is None
        assert engines.prepared == []
    finally:
        destroy_engines(engines)


def test_an_adoption_that_fails_is_the_engines_death(ray_local, tiny_model):
    engines = create_vllm_engines(
        1, tiny_model, 128, name_prefix="test-prepared-bad-anchor", backend="hf", prepared_actors=1
    )
    try:
        (prepared,) = engines.prepared
        get(prepared.up, 120, prepared.name)
        config = engines.configs[0].model_copy(update={"name": prepared.name})
        # Options Ray refuses for the anchor.
        get(prepared.handle.adopt.remote(config, {}, {"num_cpus": -1}), 30)
        with pytest.raises(EngineDeadError, match="could not take the lost engine's place"):
            get(prepared.handle.ready.remote(), 120)
    finally:
        destroy_engines(engines)
