"""The engine-set spec of a run's engine section, the engines the CLI starts
before its flow (passed to it), and `create_engines` taking them. Engine
creation is faked here: the CLI demo test runs the real thing."""

from __future__ import annotations

import pytest

import tasks.engines as engines_tasks
from engines import EngineSetSpec, Placement, PlacementMode
from tasks.engines import engine_spec, start_early, take_early
from tasks.run.params import EngineParams


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture
def spec(model_dir) -> EngineSetSpec:
    return EngineSetSpec(
        pretrain=model_dir,
        backend="hf",
        num_engines=2,
        max_len=256,
        gpu_memory_utilization=0.9,
        seed=42,
        engine_kwargs={"dtype": "float32"},
    )


@pytest.fixture
def started(monkeypatch) -> list[EngineSetSpec]:
    """The specs `start_engine_set` was asked to start; the fake "engine
    set" it returns is its call's index."""
    specs: list[EngineSetSpec] = []

    def start(spec):
        specs.append(spec)
        return len(specs) - 1

    monkeypatch.setattr(engines_tasks, "start_engine_set", start)
    return specs


@pytest.fixture
def destroyed(monkeypatch) -> list:
    sets: list = []
    monkeypatch.setattr(engines_tasks, "destroy_engines", sets.append)
    return sets


def test_the_flow_takes_the_engines_started_early_for_its_spec(spec, started, destroyed):
    early = start_early(spec)
    assert started == [spec]
    taken = take_early(early, spec.model_copy(update={"engine_kwargs": {"dtype": "float32"}}))
    assert taken is not None and taken.engines == early.engines
    assert take_early(None, spec) is None
    assert destroyed == []


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 43},
        {"num_engines": 1},
        {"engine_kwargs": {}},
        {"spare_engines": 1},
        {"placement": Placement(PlacementMode.WITH_TRAINER)},
        {"openai_api": True},
    ],
)
def test_early_engines_for_another_spec_are_destroyed(spec, started, destroyed, change):
    early = start_early(spec)
    assert take_early(early, spec.model_copy(update=change)) is None
    assert destroyed == [early.engines]


def test_every_field_of_the_engine_section_reaches_the_spec(spec, model_dir):
    section = EngineParams(
        num_engines=2,
        max_len=256,
        gpu_memory_utilization=0.9,
        engine_kwargs={"dtype": "float32"},
    )
    assert engine_spec(section, pretrain=model_dir, backend="hf", seed=42) == spec
    fp8 = section.model_copy(update={"quantization": "fp8"})
    assert engine_spec(fp8, pretrain=model_dir, backend="vllm", seed=42).quantization == "fp8"
    # `model` is the section's name for the spec's `pretrain` (resolved first).
    assert set(EngineParams.model_fields) - set(EngineSetSpec.model_fields) == {"model"}


def test_early_engines_keep_their_own_endpoint_token(spec, started, destroyed, model_dir):
    section = EngineParams(num_engines=2, max_len=256, openai_api=True, tool_call_parser="hermes")
    first = engine_spec(section, pretrain=model_dir, backend="hf")
    second = engine_spec(section, pretrain=model_dir, backend="hf")
    assert first.api_key != second.api_key and first.tool_call_parser == "hermes"
    early = start_early(first)
    assert take_early(early, second) is early and destroyed == []
