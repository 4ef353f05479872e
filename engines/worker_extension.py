"""The weight-sync router inside each process that holds the model: vLLM's
`worker_extension_cls` points here, and the CPU backend's worker subclasses
it. Engines call its methods through `collective_rpc`; each routes to the
worker's `WorkerWeights` (`engines/weight_sync/worker.py`, what every
transport shares) or to the transport that registered the name.

Contract: the host class provides `self.model_runner.get_model()` (vLLM) or
overrides `_model()`; `self.device`; `self.rank` (tensor-parallel rank); on
vLLM, `self.model_config`; its backend's LoRA adapter store
(`new_adapter_store`: vLLM's here, the CPU backend's worker overrides it).
Method names avoid those vLLM 0.26 reserves on its Worker
(`update_weights`, `start_weight_update`, ...): vLLM refuses an extension
that shadows one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from engines.weight_sync.factory import add_transport_methods
from engines.weight_sync.formats.adapter import AdapterStore
from engines.weight_sync.worker import CORE_WORKER_METHODS, WorkerWeights


def routed(function: Callable[..., Any]) -> Callable[..., Any]:
    """A worker method that calls `function(self's WorkerWeights, ...)`."""

    @functools.wraps(function)
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return function(self._weight_worker(), *args, **kwargs)

    return method


class WeightSyncWorkerExtension:
    # Made on first use: vLLM mixes this class into its Worker, whose
    # __init__ we do not control.
    _weight_sync_state: WorkerWeights | None = None

    def _model(self):
        # get_model() unwraps the CUDA-graph wrapper vLLM may put around the model.
        return self.model_runner.get_model()

    def new_adapter_store(self) -> AdapterStore:
        """The LoRA adapters of this vLLM worker (its LoRA manager's)."""
        from engines.vllm.adapters import VllmAdapters

        return VllmAdapters(self)

    def _weight_worker(self) -> WorkerWeights:
        if self._weight_sync_state is None:
            self._weight_sync_state = WorkerWeights(self)
        return self._weight_sync_state


for _name in CORE_WORKER_METHODS:
    setattr(WeightSyncWorkerExtension, _name, routed(getattr(WorkerWeights, _name)))
add_transport_methods(WeightSyncWorkerExtension, "worker_methods", routed)
