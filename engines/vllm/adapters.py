"""The vLLM backend's LoRA adapters (`engines/weight_sync/lora.py` syncs them),
built from the received tensors and registered with the worker's LoRA
manager (vLLM 0.26, `vllm/lora/worker_manager.py`), with no file round-trip:
`LoRAModel.from_lora_tensors` as `_load_adapter` builds one from a
directory, then the manager's `add_adapter`.

Requests name an adapter by a `LoRARequest` (`lora_request`) whose id is
registered already, so the worker's `set_active_adapters` finds it and never
reads its path (vLLM's own dummy warm-up adapters do the same,
`v1/worker/lora_model_runner_mixin.py`). An adapter evicted from the
manager's cache would be read from that path and fail: the engine keeps at
most `max_cpu_loras` (vLLM's cache, default `max_loras`) and removes its own.
verl patches `_load_adapter` to read tensors from the request instead
(`TensorLoRARequest`); registering them ahead keeps vLLM unpatched.
"""

from __future__ import annotations

import functools
from typing import Any

from engines.weight_sync.adapter import (
    LoraSpec,
    adapter_id,
    adapter_name,
    targets_missing,
    tensor_module,
)

#: vLLM requires a path; it is never read (the adapter is registered first).
IN_MEMORY_PATH = "rolloutflow://in-memory"


def lora_request(version: int) -> Any:
    """The LoRARequest of the adapter of `version`."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter_name(version), adapter_id(version), IN_MEMORY_PATH)


class VllmAdapters:
    """The adapters registered with one vLLM worker's LoRA manager."""

    def __init__(self, host: Any):
        manager = getattr(host.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM worker has no LoRA manager: start it with enable_lora")
        self.manager = manager  # LRUCacheWorkerLoRAManager
        self.device = host.device

    @property
    def adapters(self) -> Any:
        return self.manager._adapter_manager  # LRUCacheLoRAModelManager

    @functools.cached_property
    def expected_modules(self) -> set[str]:
        """The module names an adapter may target (as `_load_adapter` computes them)."""
        adapters = self.adapters
        expected: set[str] = set()
        for module in adapters.supported_lora_modules:
            expected.update(adapters.packed_modules_mapping.get(module, [module]))
            if module == "experts":
                expected.add(module)
        return expected

    def problems(
        self, spec: LoraSpec, names: list[str], version: int, remove: list[int]
    ) -> list[str]:
        config = self.manager.lora_config
        problems = []
        if spec.rank > config.max_lora_rank:
            problems.append(
                f"adapter rank {spec.rank} is above max_lora_rank={config.max_lora_rank}"
            )
        expected = self.expected_modules
        missing = targets_missing(spec, sorted(expected))
        stray = sorted({tensor_module(n) for n in names} - expected)
        if missing or stray:
            problems.append(
                f"LoRA target modules {missing or stray} are not LoRA modules of this model "
                f"({sorted(expected)})"
            )
        held = set(self.adapters.list_adapters()) - {adapter_id(v) for v in remove}
        after = len(held | {adapter_id(version)})
        if after > self.adapters.capacity:
            problems.append(
                f"{after} adapters would be loaded, above max_cpu_loras={self.adapters.capacity}: "
                "raise max_loras in the engine arguments to max_staleness + 1 (max_cpu_loras "
                "defaults to max_loras + 1)"
            )
        return problems

    def load(
        self, version: int, spec: LoraSpec, tensors: dict[str, Any], remove: list[int]
    ) -> None:
        """Remove the adapters of `remove` (room in the cache first), then
        build the adapter of `version` from `tensors` and register it."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        adapters = self.adapters
        for old in remove:
            adapters.remove_adapter(adapter_id(old))
        helper = PEFTHelper.from_dict(
            {
                **spec.peft_config(),
                "vllm_max_position_embeddings": self.manager.max_position_embeddings,
            }
        )
        helper.validate_legal(self.manager.lora_config)
        model = adapters.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            adapter_id(version),
            tensors,
            helper,
            device=str(self.device),
            dtype=self.manager.lora_config.lora_dtype,
            model_vocab_size=self.manager.vocab_size,
            weights_mapper=mapper.get_unstacked_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        # A version synced again replaces its adapter.
        adapters.remove_adapter(lora.id)
        adapters.add_adapter(lora)

    def loaded(self) -> list[str]:
        return [adapter_name(i - 1) for i in sorted(self.adapters.list_adapters())]
