"""The vLLM backend's LoRA adapters (`engines/weight_sync/lora/` syncs them),
built from the received tensors and registered with the worker's LoRA
manager (vLLM 0.26, `vllm/lora/worker_manager.py`), with no file round-trip:
`LoRAModel.from_lora_tensors` as `_load_adapter` builds one from a
directory, then the manager's `add_adapter`. Over CUDA IPC a new version
of the same layout reuses the LoRAModel of the version it replaces (`Built`):
its tensors get the new bytes, and it is registered under the new id; the
version after the first build, which replaces none, gets a spare prepared
at that build.

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
import time
from dataclasses import dataclass
from typing import Any

from engines.weight_sync.formats.adapter import (
    AdapterStore,
    LoraSpec,
    PackedAdapter,
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


def _tensors(weights: Any) -> list[Any]:
    """A LoRALayerWeights' lora_a or lora_b: one tensor, or a packed
    module's list (None where a sub-module has no adapter)."""
    listed = weights if isinstance(weights, list) else [weights]
    return [t for t in listed if t is not None]


@dataclass
class Built:
    """A registered adapter whose every tensor is a view of `own` (our copy
    of a packed adapter), so the adapter of a later version of the same
    layout is the same LoRAModel with new bytes: one copy and one scaling
    instead of building and merging 100-odd modules in Python at every sync
    (the syncs of a training run all have one layout)."""

    lora: Any  # vLLM's LoRAModel, merged (packed modules) as registered
    own: Any  # the bytes its tensors view
    bucket: Any  # their layout (buckets.Bucket)
    spec: LoraSpec
    scaling: float  # what vLLM multiplied every lora_B by as it registered it
    lora_b: list[Any]

    @classmethod
    def of(cls, lora: Any, own: Any, bucket: Any, spec: LoraSpec, scaling: float) -> Built | None:
        """None when vLLM copied a tensor as it built the adapter (another
        dtype, a stacked MoE layout): then the bytes of `own` are not all
        of it, and the next version is built anew."""
        storage = own.untyped_storage().data_ptr()
        parts = [(w.lora_a, w.lora_b) for w in lora.loras.values()]
        tensors = [t for a, b in parts for t in (*_tensors(a), *_tensors(b))]
        if not all(t.untyped_storage().data_ptr() == storage for t in tensors):
            return None
        return cls(lora, own, bucket, spec, scaling, [t for _, b in parts for t in _tensors(b)])

    def fits(self, tensors: Any, spec: LoraSpec) -> bool:
        packed = isinstance(tensors, PackedAdapter)
        return packed and spec == self.spec and tensors.bucket == self.bucket

    def refill(self, tensors: PackedAdapter, lora_id: int) -> None:
        """The bytes of `tensors`, scaled as vLLM scales a new adapter's, under `lora_id`."""
        import torch

        tensors.copy_bytes(self.own)
        if self.scaling != 1:  # vLLM's LoRALayerWeights.optimize, the same multiply
            torch._foreach_mul_(self.lora_b, self.scaling)
        # Registering a merged LoRAModel again is a no-op merge: its packed
        # modules are packed, its scalings are 1.
        self.lora.id = lora_id


class VllmAdapters(AdapterStore):
    """The adapters registered with one vLLM worker's LoRA manager."""

    def __init__(self, host: Any):
        manager = getattr(host.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM worker has no LoRA manager: start it with enable_lora")
        self.manager = manager  # LRUCacheWorkerLoRAManager
        self.device = host.device
        # version -> its adapter's reusable parts (packed adapters only)
        self._built: dict[int, Built] = {}
        # A registered-once LoRAModel of the layout, for the version after a build.
        self._spare: Built | None = None

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
        self,
        version: int,
        spec: LoraSpec,
        tensors: dict[str, Any] | PackedAdapter,
        remove: list[int],
    ) -> None:
        """Remove the adapters of `remove` (room in the cache first), then
        register the adapter of `version`: built from `tensors`, or, for a
        packed adapter of the layout of one just removed, that one's
        LoRAModel with the new bytes written into its tensors."""
        started = time.monotonic()
        adapters = self.adapters
        spare = None
        # A version synced again replaces its adapter.
        for old in [*remove, version]:
            adapters.remove_adapter(adapter_id(old))
            built = self._built.pop(old, None)
            if spare is None and built is not None and built.fits(tensors, spec):
                spare = built
        if spare is None and self._spare is not None and self._spare.fits(tensors, spec):
            spare, self._spare = self._spare, None
        removed = time.monotonic()
        self.times = {"remove_s": removed - started}
        if spare is not None:
            spare.refill(tensors, adapter_id(version))
            refilled = time.monotonic()
            adapters.add_adapter(spare.lora)
            self._built[version] = spare
            # refill_s: the new bytes into the LoRAModel of a removed version.
            self.times.update(refill_s=refilled - removed, add_s=time.monotonic() - refilled)
            return
        own, views = tensors.copy_into() if isinstance(tensors, PackedAdapter) else (None, tensors)
        lora, scaling = self._build(version, spec, views)
        adapters.add_adapter(lora)
        if own is not None:
            built = Built.of(lora, own, tensors.bucket, spec, scaling)
            if built is not None:
                self._built[version] = built
                if self._spare is None or not self._spare.fits(tensors, spec):
                    self._spare = self._prepared_spare(version, spec, tensors)
        # build_s: a LoRAModel built anew and registered (the first sync, a new
        # layout), with the spare for the next version.
        self.times["build_s"] = time.monotonic() - removed

    def _prepared_spare(self, version: int, spec: LoraSpec, tensors: PackedAdapter) -> Built | None:
        """A second LoRAModel of the layout, for the next version while this
        one still serves (requests are pinned to the version admitting them),
        so the second sync refills as later ones do instead of building. It
        is registered once (vLLM merges its packed modules and scales its
        lora_B then), removed, and refilled once, so that the first refill's
        one-time costs fall here too, not in a later sync (their figures:
        docs/weight_sync.md, LoRA adapters). None when vLLM's cache has no
        room for it beside this version (it would evict an adapter in use)."""
        adapters = self.adapters
        if len(adapters.list_adapters()) >= adapters.capacity:
            return None
        spare_id = adapter_id(version + 1)
        own, views = tensors.copy_into()
        lora, scaling = self._build(version + 1, spec, views)
        adapters.add_adapter(lora)
        adapters.remove_adapter(spare_id)
        spare = Built.of(lora, own, tensors.bucket, spec, scaling)
        if spare is not None:
            spare.refill(tensors, spare_id)
        return spare

    def _build(self, version: int, spec: LoraSpec, tensors: dict[str, Any]) -> tuple[Any, float]:
        """vLLM's LoRAModel of `tensors` (views of them, in vLLM's dtype) and
        the scaling vLLM folds into its lora_B tensors as it registers it."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict(
            {
                **spec.peft_config(),
                "vllm_max_position_embeddings": self.manager.max_position_embeddings,
            }
        )
        helper.validate_legal(self.manager.lora_config)
        model = self.adapters.model
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
        return lora, helper.vllm_lora_scaling_factor

    def loaded(self) -> list[str]:
        return [adapter_name(i - 1) for i in sorted(self.adapters.list_adapters())]
