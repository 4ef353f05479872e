"""Deadlines and failure types of calls into engines, and engine replacement."""

from __future__ import annotations

import pytest
import ray
from faults import kill_and_wait
from waiting import SETUP_TIMEOUT_S

from engines import (
    EngineDeadError,
    EngineTimeoutError,
    SamplingParams,
    batch_vllm_engine_call,
    call_engines,
    create_vllm_engines,
    destroy_engines,
    replace_engine,
)


@pytest.fixture
def engines(ray_local, tiny_model):
    engines = create_vllm_engines(2, tiny_model, 256, 0.5, seed=7, name_prefix="test-client")
    ray.get([e.ready.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
    yield engines
    destroy_engines(engines)


def test_hung_engine_is_a_timeout_and_dead_engine_is_dead(engines):
    ray.get(engines[0].pause_generation.remote(), timeout=30)  # generate now waits forever
    kill_and_wait(engines[1])
    params = SamplingParams(max_tokens=2)
    results = call_engines(engines, "generate", [1, 2, 3], params, timeout_s=2)
    assert isinstance(results[0].error, EngineTimeoutError)
    assert results[0].error.engine == "test-client-0"
    assert isinstance(results[1].error, EngineDeadError)
    assert "test-client-1" in str(results[1].error)
    # A call that cannot answer (paused generation), not a deadline too short
    # to answer in: under load an answer came within 1 ms.
    with pytest.raises(EngineTimeoutError, match="test-client-0"):
        batch_vllm_engine_call(engines, "generate", [1, 2, 3], params, timeout_s=2)


def test_replace_engine_keeps_name_seed_and_bundles(engines):
    before = ray.get(engines[1].health.remote(), timeout=30)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = ray.get(engines[1].generate.remote([4, 5, 6], params), timeout=60)
    ray.kill(engines[1], no_restart=True)
    new = replace_engine(engines, 1)
    assert engines[1] is new
    after = ray.get(new.health.remote(), timeout=SETUP_TIMEOUT_S)
    assert (after["name"], after["seed"], after["bundle_indices"]) == (
        before["name"],
        before["seed"],
        before["bundle_indices"],
    )
    assert after["pid"] != before["pid"]
    # Same seed, same first request: the replacement replays the dead engine.
    again = ray.get(new.generate.remote([4, 5, 6], params), timeout=60)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
