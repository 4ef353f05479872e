"""The vLLM backend's adapter checks (engines/vllm/adapters.py) against a
stand-in for vLLM 0.26's LoRA manager (CI has no vLLM): what a sync into it
is refused for, before anything is built."""

from __future__ import annotations

from types import SimpleNamespace

from engines.vllm.adapters import VllmAdapters
from engines.weight_sync.adapter import LoraSpec, adapter_id

NAME = "base_model.model.model.layers.0.self_attn.{}.lora_A.weight"


def adapters(loaded: list[int], capacity: int = 2) -> VllmAdapters:
    manager = SimpleNamespace(
        lora_config=SimpleNamespace(max_lora_rank=16),
        _adapter_manager=SimpleNamespace(
            supported_lora_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
            packed_modules_mapping={
                "qkv_proj": ["q_proj", "k_proj", "v_proj"],
                "gate_up_proj": ["gate_proj", "up_proj"],
            },
            capacity=capacity,
            list_adapters=lambda: {adapter_id(v): None for v in loaded},
        ),
    )
    return VllmAdapters(
        SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager), device="cuda:0")
    )


def test_an_adapter_of_the_model_s_lora_modules_fits():
    spec = LoraSpec(16, 32.0, ("q_proj", "v_proj"))
    names = [NAME.format("q_proj"), NAME.format("v_proj")]
    assert adapters([3]).problems(spec, names, version=4, remove=[]) == []


def test_a_rank_or_module_vllm_cannot_serve_is_named():
    spec = LoraSpec(32, 32.0, ("q_proj", "qkv_fused"))
    (rank, modules) = adapters([]).problems(spec, [NAME.format("q_proj")], 1, [])
    assert rank == "adapter rank 32 is above max_lora_rank=16"
    assert modules.startswith("LoRA target modules ['qkv_fused'] are not LoRA modules")


def test_more_adapters_than_vllm_s_cache_holds_are_refused():
    spec = LoraSpec(8, 16.0, ("q_proj",))
    (problem,) = adapters([2, 3]).problems(spec, [NAME.format("q_proj")], 4, remove=[])
    assert problem.startswith("3 adapters would be loaded, above max_cpu_loras=2")
    assert adapters([2, 3]).problems(spec, [NAME.format("q_proj")], 4, remove=[2]) == []
