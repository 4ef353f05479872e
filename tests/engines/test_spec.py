"""engines/spec.py: reading vLLM's engine-argument fields without importing vLLM."""

from __future__ import annotations

import sys
import textwrap

import pytest

from engines import spec

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
