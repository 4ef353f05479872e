"""The receiving side inside one worker that holds the model (a vLLM GPU
worker or the CPU backend's worker): what every transport shares (loading
through the copy plan, checksums of what arrived, the backup; on top of the
manifest it accepts, `worker_manifest.py`, and its weight group,
`worker_group.py`). Transport-specific receives live in their transport's
module and take this object as their first argument.

Arguments and results are plain data: vLLM's collective_rpc crosses a msgpack
hop that refuses torch types.
"""

from __future__ import annotations

import logging
from typing import Any

from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats.adapter import AdapterStore
from engines.weight_sync.formats.checksum import device_sums, finish_checksums, nbytes_of
from engines.weight_sync.protocol import WorkerAnswer
from engines.weight_sync.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

#: (vLLM model class, quantization) pairs whose `load_weights` the copy plan
#: is proven to replay exactly: their loaders record cleanly against vLLM
#: 0.26's code, and the engines' logprobs matched the trainer's after
#: replayed syncs on the H200s (docs/weight_sync.md "Architectures",
#: tests/gpu/test_gpu_architectures.py; unquantized bf16 only). Any other
#: pair (another class, or a quantized engine, whose parameters are not the
#: trainer's tensors: an FP8 weight and its scale) loads through vLLM's own
#: layerwise reload on every sync (`load_weights`, then each layer's post-load
#: processing: MoE expert layouts, online quantization), as vLLM's own
#: weight-transfer engines do.
REPLAY_PROVEN = frozenset({("LlamaForCausalLM", None), ("Qwen2ForCausalLM", None)})


def unproven(model: Any, model_config: Any) -> str | None:
    """Why a vLLM model's loads do not replay recorded copies (vLLM's
    layerwise reload then), or None: its (class, quantization) decides."""
    kind = (type(model).__name__, model_config.quantization)
    return None if kind in REPLAY_PROVEN else "{} (quantization {}) is not proven".format(*kind)


class WorkerWeights(WorkerGroup):
    """One worker's weight-sync state; `host` has `_model()`, `device`, `rank`,
    `model_config`, and makes the backend's LoRA adapter store (`new_adapter_store`)."""

    def __init__(self, host: Any):
        super().__init__(host)
        self.backup: dict[str, Any] | None = None
        # name -> (bytes, checksum sums on the device) of what this sync received.
        self.wire_sums: dict[str, tuple[int, Any]] | None = None
        self.copy_plan: Any = None  # CopyPlan, made on the first load
        self.reloading = False  # inside vLLM's layerwise reload (unproven models)
        # Per transport, what it keeps between calls; dropped after a failed sync.
        self.held: dict[str, Any] = {}
        # The LoRA adapters served (`lora.worker.adapter_store`): kept through failed syncs.
        self.adapters: AdapterStore | None = None

    # --- loading -----------------------------------------------------------------------
    def unproven(self) -> str | None:
        return unproven(self.model(), self.host.model_config) if self.is_vllm_model() else None

    def replays(self) -> bool:
        return self.unproven() is None

    def load(
        self, weights: list[tuple[str, Any]], repeat: bool = False, token: str | None = None
    ) -> None:
        """Load through the model's loader once, then replay its copies
        (`repeat`, `token`: see CopyPlan.load); models not proven for replay
        go through vLLM's layerwise reload."""
        if not self.replays():
            self._reload(weights)
            return
        if self.copy_plan is None:
            from engines.weight_sync.formats.copy_plan import CopyPlan

            self.copy_plan = CopyPlan(self.model(), self._model_loader())
        self.copy_plan.load(weights, repeat=repeat, token=token)

    def _model_loader(self):
        model = self.model()
        if self.is_vllm_model():
            return lambda weights: model.load_weights(weights=weights)
        params = dict(model.named_parameters())

        def copy_by_name(weights: list[tuple[str, Any]]) -> None:
            for name, tensor in weights:
                if name not in params:
                    raise WeightSyncError(f"the model has no parameter {name!r}")
                params[name].copy_(tensor)

        return copy_by_name

    def _reload(self, weights: list[tuple[str, Any]]) -> None:
        model = self.model()
        if not self.reloading:
            try:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
            except ImportError as exc:
                raise WeightSyncError(
                    f"{self.unproven()} for copy-plan replay and vLLM's layerwise reload "
                    f"is not available ({exc})"
                ) from exc
            initialize_layerwise_reload(model)
            self.reloading = True
        model.load_weights(weights=weights)

    def finish_reload(self) -> None:
        """Run the post-load processing of a layerwise reload (once per sync)."""
        if self.reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self.reloading = False
            finalize_layerwise_reload(self.model(), self.host.model_config)
            # It may read a colocated trainer's tensors, which the trainer
            # writes again once the sync returns.
            if self.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.device)

    def copy_plan_status(self) -> dict:
        """Whether loads replay recorded copies (and how many), or why not."""
        plan, unproven = self.copy_plan, self.unproven()
        if unproven:
            refused = f"{unproven} for replay: vLLM's reload"
            return {"copies": 0, "refused": refused, "graph": False, "graph_error": None}
        if plan is None:
            return {"copies": 0, "refused": None, "graph": False, "graph_error": None}
        return {
            "copies": plan.size,
            "refused": plan.refused,
            "graph": plan.captured,
            "graph_error": plan.graph_error,
        }

    def record_wire(self, weights: list[tuple[str, Any]]) -> None:
        # Sums stay on the device (no host round trip per tensor); rendered
        # when the trainer asks for them.
        if self.wire_sums is None:
            self.wire_sums = {}
        for name, tensor in weights:
            self.wire_sums[name] = (nbytes_of(tensor), device_sums(tensor))

    def answer(self, answer: WorkerAnswer, verify: bool) -> dict:
        """`answer` with the checksums of what this sync received (one host
        copy), for the trainer to compare: no separate verify call."""
        if verify:
            answer.checksums = finish_checksums(self.wire_sums or {})
        return answer.plain()

    def empty_cache(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # --- the sync around a transfer ----------------------------------------------------
    def prepare_weight_sync(self, backup: bool) -> dict:
        """Before the first byte: with `backup`, keep a host copy of the
        weights to restore on failure; say which weight group this worker is in."""
        self.backup = None
        if backup:
            self.backup = {
                name: t.detach().to("cpu", copy=True)
                for name, t in self.model().state_dict(keep_vars=True).items()
            }
        return {
            "backup_bytes": sum(nbytes_of(t) for t in (self.backup or {}).values()),
            "group_id": self.weight_group_id(),
        }

    def end_weight_sync(self, restore: bool, failed: bool = False) -> dict:
        """After the sync: with `restore`, put the backup back (a failed sync);
        always drop it and the sync's checksums. After a failure, what the
        transports hold is dropped too (a trainer shares its tensors afresh)."""
        self.wire_sums = None
        self.finish_reload()  # a layerwise reload's processing, before any restore
        if failed:
            self.held.clear()
        restored = False
        if restore and self.backup is not None:
            import torch

            state = self.model().state_dict(keep_vars=True)
            with torch.no_grad():
                for name, saved in self.backup.items():
                    state[name].copy_(saved)
            restored = True
        self.backup = None
        if failed:
            self.empty_cache()  # what a receive left allocated when it failed
        return {"restored": restored}

    def weight_checksums(self, names: list[str]) -> dict[str, str | None]:
        """Checksums of the live weights by HF name where the model keeps that
        name (transformers models); of the bytes received in the last sync
        otherwise: per tensor, or per bucket (`bucket-<i>`) for a bucketed
        broadcast (vLLM fuses and shards, so its live tensors have other
        names and shapes). None for a name neither knows."""
        live = {} if self.is_vllm_model() else dict(self.model().named_parameters())
        pending = {n: (nbytes_of(live[n]), device_sums(live[n])) for n in names if n in live}
        wire = self.wire_sums or {}
        pending.update({n: wire[n] for n in names if n not in live and n in wire})
        known = finish_checksums(pending)
        return {name: known.get(name) for name in names}

    def read_weights(self, names: list[str]) -> dict[str, Any]:
        """Copies of live weights by name (HF names on transformers models,
        vLLM's own names on vLLM), for inspection and tests."""
        state = dict(self.model().named_parameters())
        missing = [n for n in names if n not in state]
        if missing:
            raise WeightSyncError(f"the model has no parameters {missing[:5]}")
        return {n: state[n].detach().to("cpu", copy=True) for n in names}


#: Worker methods every engine reaches through `collective_rpc`.
CORE_WORKER_METHODS = (
    "weight_manifest",
    "weight_manifest_problems",
    "copy_plan_status",
    "prepare_weight_sync",
    "end_weight_sync",
    "weight_checksums",
    "read_weights",
    "init_process_group",
    "destroy_weight_group",
    "has_weight_group",
    "node_address",
)
