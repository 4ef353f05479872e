"""The vLLM backend's adapter checks (engines/vllm/adapters.py) against a
stand-in for vLLM 0.26's LoRA manager (CI has no vLLM): what a sync into it
is refused for, before anything is built, and how a new version reuses the
adapter it replaces (against vLLM's way of registering one: views of the
tensors given, lora_B scaled in place)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engines.vllm.adapters import Built, VllmAdapters
from engines.weight_sync.formats.adapter import LoraSpec, PackedAdapter, adapter_id
from engines.weight_sync.formats.buckets import pack_bucket, plan_buckets
from engines.weight_sync.formats.manifest import Manifest

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


def packed(values: dict[str, torch.Tensor]) -> PackedAdapter:
    manifest = Manifest.of(list(values.items()))
    (bucket,) = plan_buckets(manifest, 1 << 20).buckets
    return PackedAdapter(pack_bucket(bucket, values), bucket)


def merged(views: dict[str, torch.Tensor], scaling: float, lora_id: int) -> SimpleNamespace:
    """What vLLM 0.26 registers: views of the tensors given, lora_B scaled in place."""
    loras = {}
    for name, tensor in views.items():
        module = name.split(".lora_")[0]
        weights = loras.setdefault(module, SimpleNamespace(lora_a=None, lora_b=None))
        if ".lora_A." in name:
            weights.lora_a = tensor
        else:
            weights.lora_b = tensor.mul_(scaling)
    return SimpleNamespace(id=lora_id, loras=loras)


def test_a_new_version_of_one_layout_is_the_removed_adapter_refilled():
    spec = LoraSpec(2, 8.0, ("q_proj",))
    names = [NAME.format("q_proj"), NAME.format("q_proj").replace("lora_A", "lora_B")]
    first = {names[0]: torch.ones(2, 4), names[1]: torch.ones(4, 2)}
    own, views = packed(first).copy_into()
    lora = merged(views, 4.0, adapter_id(1))
    built = Built.of(lora, own, packed(first).bucket, spec, 4.0)
    assert built is not None
    second = {names[0]: torch.full((2, 4), 3.0), names[1]: torch.full((4, 2), 5.0)}
    assert built.fits(packed(second), spec)
    assert not built.fits(packed(second), LoraSpec(2, 16.0, ("q_proj",)))
    built.refill(packed(second), adapter_id(2))
    (weights,) = lora.loras.values()
    assert lora.id == adapter_id(2)
    assert torch.equal(weights.lora_a, second[names[0]])
    assert torch.equal(weights.lora_b, second[names[1]] * 4.0)  # as vLLM scales a new one


def test_an_adapter_vllm_copied_is_built_anew():
    spec = LoraSpec(2, 8.0, ("q_proj",))
    values = {NAME.format("q_proj"): torch.ones(2, 4)}
    adapter = packed(values)
    own, views = adapter.copy_into()
    copied = {n: t.clone() for n, t in views.items()}  # another dtype would copy so
    assert Built.of(merged(copied, 4.0, 1), own, adapter.bucket, spec, 4.0) is None
    assert Built.of(merged(views, 4.0, 1), own, adapter.bucket, spec, 4.0) is not None


class Registry:
    """vLLM 0.26's LRU adapter cache as the store uses it: registering
    merges and scales each lora_B once (`optimize`: scaling then 1)."""

    def __init__(self, capacity: int):
        self.capacity, self.registered = capacity, {}

    def list_adapters(self) -> dict:
        return dict(self.registered)

    def add_adapter(self, lora) -> None:
        for weights in lora.loras.values():
            if weights.scaling != 1:
                weights.lora_b.mul_(weights.scaling)
                weights.scaling = 1
        self.registered[lora.id] = lora

    def remove_adapter(self, lora_id: int) -> None:
        self.registered.pop(lora_id, None)


def built_of_views(store, version, spec, views):
    """What `LoRAModel.from_lora_tensors` builds: views of the tensors given."""
    loras = {}
    for name, tensor in views.items():
        module = name.split(".lora_")[0]
        weights = loras.setdefault(module, SimpleNamespace(lora_a=None, lora_b=None, scaling=4.0))
        setattr(weights, "lora_a" if ".lora_A." in name else "lora_b", tensor)
    return SimpleNamespace(id=adapter_id(version), loras=loras), 4.0


def test_the_version_after_the_first_build_refills_a_spare_scaled_once(monkeypatch):
    """The first build prepares a spare (registered once, removed), so the
    next version, which replaces none, is refilled, not built, and scaled
    once; with no room in vLLM's cache beside the first, none is prepared."""
    monkeypatch.setattr(VllmAdapters, "_build", built_of_views)
    spec = LoraSpec(2, 8.0, ("q_proj",))
    a, b = NAME.format("q_proj"), NAME.format("q_proj").replace("lora_A", "lora_B")

    def version(value: float) -> PackedAdapter:
        return packed({a: torch.full((2, 4), value), b: torch.full((4, 2), value)})

    store = adapters([])
    registry = store.manager._adapter_manager = Registry(capacity=2)
    store.load(1, spec, version(1.0), remove=[])
    assert "build_s" in store.times and set(registry.registered) == {adapter_id(1)}
    store.load(2, spec, version(2.0), remove=[])
    assert "refill_s" in store.times and "build_s" not in store.times
    assert set(registry.registered) == {adapter_id(1), adapter_id(2)}
    for v, value in ((1, 1.0), (2, 2.0)):
        (weights,) = registry.registered[adapter_id(v)].loras.values()
        assert torch.equal(weights.lora_a, torch.full((2, 4), value))
        assert torch.equal(weights.lora_b, torch.full((4, 2), value * 4.0)), v
    store.load(3, spec, version(3.0), remove=[1])  # the replaced one's, as before
    assert "refill_s" in store.times
    full = adapters([])
    full.manager._adapter_manager = Registry(capacity=1)
    full.load(1, spec, version(1.0), remove=[])
    full.load(2, spec, version(2.0), remove=[1])
    assert "refill_s" in full.times
    assert full._spare is None
