"""`create_vllm_engines` as a translation into `EngineSetSpec` (the drop-in
test, test_openrlhf_drop_in.py, drives OpenRLHF's own code against it)."""

from __future__ import annotations

import pytest

import engines.openrlhf.vllm_engine as openrlhf
from engines import EngineSetSpec, EngineSpecError, Placement, PlacementMode


@pytest.fixture
def started(monkeypatch) -> list[EngineSetSpec]:
    specs: list[EngineSetSpec] = []
    monkeypatch.setattr(openrlhf, "start_engine_set", specs.append)
    return specs


def test_openrlhf_keywords_become_the_spec(started, tiny_model):
    openrlhf.create_vllm_engines(
        num_engines=2,
        pretrain=tiny_model,
        max_model_len=128,
        seed=7,
        backend="hf",
        vllm_enable_sleep=True,
        logprobs_mode="processed_logprobs",
        colocate_trainer=True,
        dtype="float32",
    )
    (spec,) = started
    assert (spec.num_engines, spec.max_len, spec.seed, spec.sleep) == (2, 128, 7, True)
    assert spec.placement == Placement(PlacementMode.WITH_TRAINER)
    assert spec.engine_kwargs == {
        "max_logprobs": 1,
        "dtype": "float32",
        "logprobs_mode": "processed_logprobs",
    }


def test_a_setting_without_a_parameter_of_its_own_passes_as_a_keyword(
    started, tiny_model, monkeypatch
):
    class NewerSpec(EngineSetSpec):
        quantization: str | None = None

    monkeypatch.setattr(openrlhf, "EngineSetSpec", NewerSpec)
    openrlhf.create_vllm_engines(1, tiny_model, 128, backend="hf", quantization="fp8")
    (spec,) = started
    assert spec.quantization == "fp8" and spec.engine_kwargs == {}


def test_refused_before_anything_starts(started, tiny_model):
    with pytest.raises(EngineSpecError, match="max_len=64 and max_model_len=128"):
        openrlhf.create_vllm_engines(1, tiny_model, 64, max_model_len=128, backend="hf")
    assert started == []
