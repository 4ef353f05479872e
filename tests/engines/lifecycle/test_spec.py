"""engines/lifecycle/spec.py: the engine-set spec's checks (each bad value named, before
anything exists), and reading vLLM's engine-argument fields without importing
vLLM. `test_bad_input.py` drives the same checks through `create_vllm_engines`
on a real Ray."""

from __future__ import annotations

import sys
import textwrap

import pytest

from engines import EngineSetSpec, EngineSpecError, Placement, PlacementMode
from engines.config import EngineConfig, EngineSettings
from engines.lifecycle import spec

ARG_UTILS = textwrap.dedent(
    """
    from dataclasses import dataclass, InitVar
    from typing import ClassVar

    @dataclass
    class EngineArgs:
        model: str = "m"
        enforce_eager: bool = False
        registry: ClassVar[dict] = {}
        scratch: InitVar[int] = 0

        def method(self):
            local: int = 1

    @dataclass
    class AsyncEngineArgs(EngineArgs):
        enable_log_requests: bool = False
    """
)


def test_dataclass_fields_as_dataclasses_counts_them():
    fields = spec.dataclass_fields(ARG_UTILS, spec.VLLM_ARGS_CLASSES)
    assert fields == {"model", "enforce_eager", "enable_log_requests"}


def test_a_missing_class_reads_as_no_fields():
    assert spec.dataclass_fields("class EngineArgs:\n    model: str\n", spec.VLLM_ARGS_CLASSES) == (
        frozenset()
    )


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """An installed-looking `vllm` whose import fails: the fields must come
    from its source alone."""
    package = tmp_path / "vllm"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    spec.vllm_engine_fields.cache_clear()
    yield package
    spec.vllm_engine_fields.cache_clear()


def test_engine_fields_are_read_from_vllms_source_without_importing_it(fake_vllm):
    (fake_vllm / "engine" / "arg_utils.py").write_text(ARG_UTILS)
    assert spec.vllm_engine_fields() == {"model", "enforce_eager", "enable_log_requests"}
    assert "vllm" not in sys.modules


def test_a_source_of_another_shape_falls_back_to_the_import(fake_vllm):
    (fake_vllm / "engine" / "arg_utils.py").write_text("ENGINE_ARGS = {}\n")
    with pytest.raises(RuntimeError, match="vllm was imported"):
        spec.vllm_engine_fields()


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture
def no_vllm_fields(monkeypatch):
    """vLLM's field list as CI has it: none (no vLLM), so engine arguments
    are not checked against it."""
    monkeypatch.setattr(spec, "vllm_engine_fields", frozenset)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_engines": 0}, "num_engines must be an integer >= 1, got 0"),
        ({"num_engines": True}, "num_engines must be an integer >= 1, got True"),
        ({"num_engines": "2"}, "num_engines must be an integer >= 1, got '2'"),
        ({"max_len": 1}, "max_len must be an integer >= 2, got 1"),
        ({"max_len": 128.0}, "max_len must be an integer >= 2, got 128.0"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        ({"spare_engines": -1}, "spare_engines must be an integer >= 0, got -1"),
        (
            {"gpu_memory_utilization": 1.5},
            r"gpu_memory_utilization must be in \(0, 1\] or None \(vLLM's default\), got 1.5",
        ),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization must be in .* got True"),
        ({"backend": "tpu"}, r"backend must be one of \('auto', 'vllm', 'hf'\), got 'tpu'"),
        ({"pretrain": ""}, "pretrain must be a model path or hub id, got ''"),
        ({"pretrain": "/nonexistent/model"}, "pretrain='/nonexistent/model' does not exist"),
        ({"seed": "seven"}, "seed='seven': Input should be a valid integer"),
        ({"name_prefx": "x"}, "name_prefx='x': Extra inputs are not permitted"),
        ({"placement": "colocated"}, "placement='colocated': Input should be"),
        ({"engine_kwargs": {"seed": 3}}, "engine argument seed=3 is set by create_vllm_engines"),
        (
            {"sleep": True, "engine_kwargs": {"enable_sleep_mode": False}},
            "sleep=True .* and enable_sleep_mode=False contradict each other",
        ),
    ],
)
def test_a_bad_value_is_named(model_dir, no_vllm_fields, change, message):
    with pytest.raises(EngineSpecError, match=message):
        EngineSetSpec(**{"pretrain": model_dir, "num_engines": 1, "max_len": 128} | change)


def test_a_missing_field_is_named(model_dir):
    with pytest.raises(EngineSpecError, match="^num_engines is required$"):
        EngineSetSpec(pretrain=model_dir, max_len=128)


def test_the_spec_is_frozen_and_defaults_to_bundles_of_its_own(model_dir):
    made = EngineSetSpec(pretrain=model_dir, num_engines=2, max_len=128)
    assert made.placement == Placement() and made.placement.mode is PlacementMode.OWN_BUNDLES
    assert (made.backend, made.seed, made.spare_engines, made.sleep) == ("auto", 42, 0, False)
    with pytest.raises(Exception, match="frozen"):
        made.num_engines = 3


def test_every_engine_setting_reaches_the_engines_config(model_dir, no_vllm_fields):
    made = EngineSetSpec(
        pretrain=model_dir,
        num_engines=2,
        max_len=128,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=2,
        enable_prefix_caching=True,
        full_determinism=True,
        engine_kwargs={"enforce_eager": True},
    )
    config = EngineConfig(**made.settings(), name="e-0", seed=1, rpc_timeout_s=5.0)
    assert set(made.settings()) == set(EngineSettings.model_fields)
    for name in EngineSettings.model_fields:
        assert getattr(config, name) == getattr(made, name), name


@pytest.mark.parametrize(
    ("change", "backend", "kwargs"),
    [
        ({}, "vllm", {}),
        ({"sleep": True}, "hf", {"enable_sleep_mode": True}),
        ({"spare_engines": 1}, "vllm", {"enable_sleep_mode": True}),
        # The CPU backend's spares sleep without it.
        ({"spare_engines": 1}, "hf", {}),
        (
            {"spare_engines": 1, "engine_kwargs": {"enable_sleep_mode": False}},
            "hf",
            {"enable_sleep_mode": False},
        ),
    ],
)
def test_engine_arguments_for_a_backend(model_dir, no_vllm_fields, change, backend, kwargs):
    made = EngineSetSpec(**{"pretrain": model_dir, "num_engines": 1, "max_len": 128} | change)
    assert made.engine_kwargs_for(backend) == kwargs


@pytest.mark.parametrize(
    ("kwargs", "backend", "message"),
    [
        ({"enable_sleep_mode": False}, "vllm", "spare_engines needs enable_sleep_mode"),
        ({"dtype": "int8"}, "hf", "dtype='int8' is not one of"),
    ],
)
def test_engine_arguments_a_backend_refuses(model_dir, no_vllm_fields, kwargs, backend, message):
    made = EngineSetSpec(
        pretrain=model_dir, num_engines=1, max_len=128, spare_engines=1, engine_kwargs=kwargs
    )
    with pytest.raises(EngineSpecError, match=message):
        made.engine_kwargs_for(backend)


def test_the_openai_endpoints_token_is_drawn_per_set_and_kept_secret(model_dir, no_vllm_fields):
    made = EngineSetSpec(pretrain=model_dir, num_engines=2, max_len=128, openai_api=True)
    key = made.api_key
    assert key and len(key) >= 32 and key not in repr(made) and key not in str(made)
    assert key not in made.model_dump_json()
    other = EngineSetSpec(pretrain=model_dir, num_engines=2, max_len=128, openai_api=True)
    assert other.api_key != key  # one per run
    config = EngineConfig(**made.settings(), name="e-0", seed=1, rpc_timeout_s=5.0)
    assert config.api_key == key and key not in repr(config)
    given = EngineSetSpec(
        pretrain=model_dir, num_engines=1, max_len=128, openai_api=True, openai_api_key="mine"
    )
    assert given.api_key == "mine"
    off = EngineSetSpec(pretrain=model_dir, num_engines=1, max_len=128)
    assert (off.openai_api, off.api_key) == (False, None)


def test_the_cpu_backend_names_its_tool_call_parsers(model_dir, no_vllm_fields):
    made = EngineSetSpec(pretrain=model_dir, num_engines=1, max_len=128, tool_call_parser="x")
    with pytest.raises(EngineSpecError, match=r"tool_call_parser='x' is not one of .*'hermes'"):
        made.engine_kwargs_for("hf")
    assert made.engine_kwargs_for("vllm") == {}  # vLLM checks its own names
