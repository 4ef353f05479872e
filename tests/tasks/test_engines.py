"""The engines a process starts before its flow (the CLI's early start), and
`create_engines` taking them. Engine creation is faked here: the CLI demo
test runs the real thing."""

from __future__ import annotations

import dataclasses

import pytest

import tasks.engines as engines_tasks
from tasks.engines import EngineRequest, start_early, take_early

REQUEST = EngineRequest(
    model="/models/tiny",
    backend="hf",
    num_engines=2,
    tensor_parallel_size=1,
    max_len=256,
    gpu_memory_utilization=0.9,
    seed=42,
    engine_kwargs={"dtype": "float32"},
)


@pytest.fixture
def created(monkeypatch) -> list[tuple]:
    """What `create_vllm_engines` was asked for (each call's arguments); the
    fake "engine set" it returns is its call's index. `destroyed` lists the
    sets destroyed."""
    calls: list[tuple] = []
    monkeypatch.setattr(engines_tasks, "_early", None)

    def create(*args, **kwargs):
        calls.append((args, kwargs))
        return len(calls) - 1

    monkeypatch.setattr(engines_tasks, "create_vllm_engines", create)
    return calls


@pytest.fixture
def destroyed(monkeypatch) -> list:
    sets: list = []
    monkeypatch.setattr(engines_tasks, "destroy_engines", sets.append)
    return sets


def test_the_request_starts_what_it_names(created):
    REQUEST.start("rf-run-a1", "rolloutflow-run")
    ((args, kwargs),) = created
    assert args == (2, "/models/tiny", 256, 0.9, 1, 42)
    assert kwargs == dict(
        backend="hf",
        name_prefix="rf-run-a1",
        namespace="rolloutflow-run",
        spare_engines=0,
        colocate_trainer=False,
        dtype="float32",
    )


def test_the_flow_takes_the_engines_started_early_for_its_request(created, destroyed):
    engines = start_early(REQUEST)
    early = take_early(dataclasses.replace(REQUEST, engine_kwargs={"dtype": "float32"}))
    assert early is not None and early.engines == engines
    assert take_early(REQUEST) is None  # taken once
    assert destroyed == []


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 43},
        {"num_engines": 1},
        {"engine_kwargs": None},
        {"spare_engines": 1},
        {"colocate_trainer": True},
    ],
)
def test_early_engines_for_another_request_are_destroyed(created, destroyed, change):
    engines = start_early(REQUEST)
    assert take_early(dataclasses.replace(REQUEST, **change)) is None
    assert destroyed == [engines]
    assert take_early(REQUEST) is None


def test_one_early_start_per_process(created):
    start_early(REQUEST)
    with pytest.raises(RuntimeError, match="already started early"):
        start_early(REQUEST)
    assert len(created) == 1
