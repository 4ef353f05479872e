"""The CPU backend's LoRA adapters (`engines/weight_sync/lora/` syncs them):
peft's LoRA layers injected into the engine's model, one named adapter per
weight version. A batch runs each row on its own adapter, or on the base
model (peft's mixed-adapter batches).
"""

from __future__ import annotations

from typing import Any

from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.formats.adapter import (
    AdapterStore,
    LoraSpec,
    PackedAdapter,
    adapter_name,
    targets_missing,
    tensor_module,
)

#: peft's name for "no adapter" in a mixed batch.
BASE = "__base__"


class PeftAdapters(AdapterStore):
    """The adapters of one CPU worker's model, by version."""

    def __init__(self, host: Any):
        self.base = host.model
        self.model: Any = None  # the PeftModel, once an adapter came
        # Before any injection: what a target module may name.
        self.module_names = [name for name, _ in self.base.named_modules() if name]

    def problems(
        self, spec: LoraSpec, names: list[str], version: int, remove: list[int]
    ) -> list[str]:
        missing = targets_missing(spec, self.module_names)
        if missing:
            return [
                f"LoRA target modules {missing} are not modules of this model "
                f"(e.g. {sorted({n.rsplit('.', 1)[-1] for n in self.module_names})[:12]})"
            ]
        stray = sorted({tensor_module(n) for n in names} - set(spec.target_modules))
        if stray:
            return [f"adapter tensors of modules {stray} outside its target_modules"]
        return []

    def load(
        self,
        version: int,
        spec: LoraSpec,
        tensors: dict[str, Any] | PackedAdapter,
        remove: list[int],
    ) -> None:
        """Add (or replace) the adapter of `version`, then drop those of `remove`
        (in this order: peft keeps at least one adapter)."""
        from peft import LoraConfig, PeftModel, set_peft_model_state_dict

        if isinstance(tensors, PackedAdapter):
            tensors = tensors.copy_into()[1]

        name = adapter_name(version)
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.target_modules),
            bias="none",
        )
        if self.model is None:
            self.model = PeftModel(self.base, config, adapter_name=name)
        else:
            if name in self.model.peft_config:
                self.model.delete_adapter(name)
            self.model.add_adapter(name, config)
        result = set_peft_model_state_dict(self.model, tensors, adapter_name=name)
        missing = [k for k in result.missing_keys if f".{name}." in k]
        if missing:
            self.model.delete_adapter(name)
            raise WeightTransferError(f"the adapter of version {version} lacks {missing[:4]}")
        self.model.eval()  # peft's mixed batches run in eval mode only
        for old in remove:
            if adapter_name(old) in self.model.peft_config:
                self.model.delete_adapter(adapter_name(old))

    def loaded(self) -> list[str]:
        return sorted(self.model.peft_config) if self.model is not None else []

    def forward(self, adapters: list[int | None], **inputs: Any) -> Any:
        """The model on a batch whose row i runs on adapter `adapters[i]` (a
        version; None: the base model)."""
        if self.model is None:
            return self.base(**inputs)
        names = [BASE if a is None else adapter_name(a) for a in adapters]
        return self.model(adapter_names=names, **inputs)
