"""The engine-set lifecycle (engines/lifecycle/engine_set.py) on a real local Ray with
the tiny model (CPU backend): started from a spec or through
`create_vllm_engines`, restarted, destroyed."""

from __future__ import annotations

import os

import pytest
import ray
from faults import end_generation_thread
from waiting import SETUP_TIMEOUT_S

from engines import (
    EngineSetSpec,
    RequestOutput,
    SamplingParams,
    batch_vllm_engine_call,
    create_vllm_engines,
    destroy_engines,
    start_engine_set,
)
from engines.naming import placement_group_name

PROMPT = "The quick brown fox"


def live_engine_names(prefix: str, namespace: str) -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(prefix + "-")
    )


def live_groups(prefix: str) -> list[str]:
    return [
        pg_id
        for pg_id, info in ray.util.placement_group_table().items()
        if info["name"] == placement_group_name(prefix) and info["state"] != "REMOVED"
    ]


def first_tokens(engine, params: SamplingParams) -> list[list[int]]:
    ids = ray.get(engine.encode.remote(PROMPT), timeout=SETUP_TIMEOUT_S)  # waits for start-up
    output = ray.get(engine.generate.remote(ids, params), timeout=60)
    return [completion.token_ids for completion in output.outputs]


@pytest.fixture
def two_engines(ray_local, tiny_model):
    # The seed's usage example, pointed at the tiny model.
    engines = create_vllm_engines(
        num_engines=2,
        pretrain=tiny_model,
        max_len=2048,
        gpu_memory_utilization=0.8,
        tensor_parallel_size=1,
        seed=42,
        enable_prefix_caching=False,
        name_prefix="test-create",
    )
    yield engines
    destroy_engines(engines)


def test_usage_example_generates_tokens(two_engines):
    assert len(two_engines) == 2
    assert all(isinstance(h, ray.actor.ActorHandle) for h in two_engines)
    assert (
        ray.get([e.ready.remote() for e in two_engines], timeout=SETUP_TIMEOUT_S)
        == two_engines.names
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = ray.get([e.generate_text.remote(PROMPT, params) for e in two_engines], timeout=60)
    for output, name in zip(outputs, two_engines.names, strict=True):
        assert isinstance(output, RequestOutput)
        assert output.engine == name and output.weight_version == 0
        assert len(output.outputs[0].token_ids) == 8
        assert output.outputs[0].finish_reason == "length"
    healths = batch_vllm_engine_call(two_engines, "health")
    assert [h["seed"] for h in healths] == [42, 43]
    assert all(h["alive"] and h["backend"] == "hf" for h in healths)


def test_engine_actors_have_their_environment(two_engines):
    """Passed to the actor, not as a runtime_env (which makes Ray start a
    worker for it): the variables of `actor_env` are there, one Ray does not
    set among them."""

    def variable(engine, name: str) -> str | None:
        return os.environ.get(name)

    ray.get([e.ready.remote() for e in two_engines], timeout=SETUP_TIMEOUT_S)
    seen = ray.get([e.__ray_call__.remote(variable, "TOKENIZERS_PARALLELISM") for e in two_engines])
    assert seen == ["false", "false"]


def test_a_spec_starts_its_set(ray_local, tiny_model):
    spec = EngineSetSpec(
        pretrain=tiny_model, num_engines=2, max_len=256, seed=3, name_prefix="test-spec"
    )
    engines = start_engine_set(spec)
    try:
        assert engines.names == ["test-spec-0", "test-spec-1"] and engines.backend == "hf"
        assert engines.namespace == ray.get_runtime_context().namespace
        assert [(c.seed, c.bundle_indices) for c in engines.configs] == [(3, [0]), (4, [1])]
        assert all(c.max_len == 256 and c.pretrain == tiny_model for c in engines.configs)
        assert (
            ray.get([e.ready.remote() for e in engines], timeout=SETUP_TIMEOUT_S) == engines.names
        )
    finally:
        destroy_engines(engines)
    assert live_groups("test-spec") == []


def test_same_seed_same_tokens_and_engine_i_uses_seed_plus_i(ray_local, tiny_model, two_engines):
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, ignore_eos=True)
    first = [first_tokens(e, params) for e in two_engines]
    assert first[0] != first[1], "engines 0 and 1 must sample with different seeds"

    # A fresh engine with seed 43 replays what engine 1 (seed 42 + 1) produced.
    replay = create_vllm_engines(1, tiny_model, 2048, 0.8, seed=43, name_prefix="test-replay")
    try:
        assert first_tokens(replay[0], params) == first[1]
    finally:
        destroy_engines(replay)


def test_concurrent_generate_calls_all_answered(two_engines):
    engine = two_engines[0]
    ids = ray.get(engine.encode.remote(PROMPT), timeout=SETUP_TIMEOUT_S)  # waits for start-up
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=7)
    refs = [engine.generate.remote([ids, ids[:2]], params) for _ in range(8)]
    results = ray.get(refs, timeout=120)
    assert all(len(r) == 2 for r in results)
    # Same per-request seed -> same tokens, whichever batch a request landed in.
    assert len({tuple(r[0].outputs[0].token_ids) for r in results}) == 1


def test_destroy_leaves_nothing_and_is_idempotent(ray_local, tiny_model):
    namespace = ray.get_runtime_context().namespace
    engines = create_vllm_engines(2, tiny_model, 256, 0.5, name_prefix="test-destroy")
    ray.get([e.ready.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
    assert live_engine_names("test-destroy", namespace) == engines.names
    assert len(live_groups("test-destroy")) == 1

    assert destroy_engines(engines) == 2
    assert live_engine_names("test-destroy", namespace) == []
    assert live_groups("test-destroy") == []
    # A second call, by handles or by name, is a no-op.
    assert destroy_engines(engines) == 0
    assert destroy_engines(name_prefix="test-destroy", namespace=namespace) == 0


def test_destroy_by_name_from_prefix_only(ray_local, tiny_model):
    """What a failure hook in another process does: no handles, only names."""
    namespace = "test-hook-ns"
    engines = create_vllm_engines(
        1, tiny_model, 256, 0.5, name_prefix="test-byname", namespace=namespace
    )
    ray.get(engines[0].ready.remote(), timeout=SETUP_TIMEOUT_S)
    assert destroy_engines(name_prefix="test-byname", namespace=namespace) == 1
    assert live_engine_names("test-byname", namespace) == []
    assert live_groups("test-byname") == []


def test_prompt_too_long_is_per_request(two_engines):
    from engines import PromptTooLongError

    engine = two_engines[0]
    ray.get(engine.ready.remote(), timeout=SETUP_TIMEOUT_S)
    with pytest.raises(PromptTooLongError, match="2048 tokens; max_len=2048"):
        ray.get(engine.generate.remote([5] * 2048, SamplingParams()), timeout=60)
    # The engine keeps serving.
    output = ray.get(engine.generate.remote([5, 6, 7], SamplingParams(max_tokens=2)), timeout=60)
    assert len(output.outputs[0].token_ids) >= 1


def test_engine_that_died_restarts_in_its_actor(ray_local, tiny_model):
    from engines import restart_engine
    from engines.client import get
    from engines.errors import EngineDeadError

    engines = create_vllm_engines(1, tiny_model, 256, 0.5, name_prefix="test-restart")
    try:
        engine = engines[0]
        params = SamplingParams(n=2, max_tokens=8, temperature=1.0, ignore_eos=True)
        first = first_tokens(engine, params)
        pid = get(engine.health.remote(), 30)["pid"]
        end_generation_thread(engine)
        with pytest.raises(EngineDeadError, match="generation thread ended"):
            get(engine.health.remote(), 30)

        assert restart_engine(engines, 0)
        assert get(engine.ready.remote(), 120) == engines.names[0]
        health = get(engine.health.remote(), 30)
        assert health["pid"] == pid and health["weight_version"] == 0
        # The pretrained weights and the engine's seed again: what it drew first.
        assert first_tokens(engine, params) == first
        # Timed from the restart: the process's own imports are not in it.
        phases = [p.name for p in get(engine.startup_report.remote(), 30).phases]
        assert "imports" not in phases and "model load" in phases

        # A restart that fails leaves the engine dead, and the actor refuses
        # another: the caller then replaces the actor.
        def lose_the_model(actor) -> None:
            actor.config = actor.config.model_copy(update={"pretrain": "/nonexistent/model"})

        end_generation_thread(engine)
        get(engine.__ray_call__.remote(lose_the_model), 30)
        assert restart_engine(engines, 0)
        with pytest.raises(EngineDeadError, match="did not restart in its actor"):
            get(engine.ready.remote(), 120)
        assert not restart_engine(engines, 0)

        ray.kill(engine, no_restart=True)
        assert not restart_engine(engines, 0)  # no actor to restart it in
    finally:
        destroy_engines(engines)
