"""The engine request of a run's engine section, the engines the CLI starts
before its flow (passed to it), and `create_engines` taking them. Engine
creation is faked here: the CLI demo test runs the real thing."""

from __future__ import annotations

import dataclasses

import pytest

import tasks.engines as engines_tasks
from tasks.engines import EngineRequest, start_early, take_early
from tasks.run.params import EngineParams

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
    early = start_early(REQUEST)
    taken = take_early(early, dataclasses.replace(REQUEST, engine_kwargs={"dtype": "float32"}))
    assert taken is not None and taken.engines == early.engines
    assert take_early(None, REQUEST) is None
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
    early = start_early(REQUEST)
    assert take_early(early, dataclasses.replace(REQUEST, **change)) is None
    assert destroyed == [early.engines]


def test_every_field_of_the_engine_section_reaches_the_request():
    section = EngineParams(
        num_engines=2,
        max_len=256,
        gpu_memory_utilization=0.9,
        engine_kwargs={"dtype": "float32"},
    )
    request = EngineRequest.of(section, model="/models/tiny", backend="hf", seed=42)
    assert request == REQUEST
    named = {field.name for field in dataclasses.fields(EngineRequest)}
    assert set(EngineParams.model_fields) - named == set()  # none is dropped
