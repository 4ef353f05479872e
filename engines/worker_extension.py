"""The weight-sync router inside each process that holds the model: vLLM's
`worker_extension_cls` points here, and the CPU backend's worker subclasses
it. Engines call its methods through `collective_rpc`; each routes to the
worker's `WorkerWeights` (`engines/weight_sync/worker.py`, what every
transport shares: written on the class below) or to the transport that
registered the name (added from the registry).

Contract: the host class provides `self.model_runner.get_model()` (vLLM) or
overrides `_model()`; `self.device`; `self.rank` (tensor-parallel rank); on
vLLM, `self.model_config`. Method names avoid those vLLM 0.26 reserves on
its Worker (`update_weights`, `start_weight_update`, ...): vLLM refuses an
extension that shadows one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from engines.weight_sync.protocol import transports
from engines.weight_sync.worker import WorkerWeights


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

    def _weight_worker(self) -> WorkerWeights:
        if self._weight_sync_state is None:
            self._weight_sync_state = WorkerWeights(self)
        return self._weight_sync_state

    # What every transport shares (worker.py)
    weight_manifest = routed(WorkerWeights.weight_manifest)
    weight_manifest_problems = routed(WorkerWeights.weight_manifest_problems)
    copy_plan_status = routed(WorkerWeights.copy_plan_status)
    prepare_weight_sync = routed(WorkerWeights.prepare_weight_sync)
    end_weight_sync = routed(WorkerWeights.end_weight_sync)
    weight_checksums = routed(WorkerWeights.weight_checksums)
    read_weights = routed(WorkerWeights.read_weights)
    init_process_group = routed(WorkerWeights.init_process_group)
    destroy_weight_group = routed(WorkerWeights.destroy_weight_group)
    has_weight_group = routed(WorkerWeights.has_weight_group)
    node_address = routed(WorkerWeights.node_address)


def _add_transport_methods() -> None:
    """Each registered transport's worker methods; a name taken twice is refused."""
    owners = {n: "the worker" for n in vars(WeightSyncWorkerExtension) if not n.startswith("_")}
    for transport in transports():
        for name, function in transport.worker_methods.items():
            if name in owners:
                raise TypeError(f"{transport.name!r} and {owners[name]} both register {name!r}")
            owners[name] = repr(transport.name)
            setattr(WeightSyncWorkerExtension, name, routed(function))


_add_transport_methods()
