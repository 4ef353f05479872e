"""Transport: CUDA IPC, for engines on the trainer's own GPU(s) (one GPU
cannot hold two NCCL ranks, so colocated engines sync this way).

No buffer and no packing: the engines open the trainer's own tensors by
`reduce_tensor` handle (`ipc_handles.py`) and copy straight from them.

Tensors seen at the same addresses in two syncs in a row are the trainer's
parameters (updated in place): the engines keep them mapped, later syncs send
no handles, and the engines replay their copies as one CUDA graph. Then a
worker answers with its copies queued and the trainer waits on their
event (`formats/copy_events.py`).

Trainer: `CudaIpcSender`. Engine actor: `receive_shared_weights`,
`release_shared_weights`. Worker: the same names.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from engines.client import call_engines
from engines.weight_sync.config import SyncConfig
from engines.weight_sync.coordinator import (
    Coordinator,
    ManifestCache,
    Phases,
    Weights,
    as_engine_list,
    trainer_weights,
)
from engines.weight_sync.errors import WeightSyncError, WeightTransferError
from engines.weight_sync.formats.checksum import nbytes_of
from engines.weight_sync.formats.copy_events import CopyEvents, record_copies
from engines.weight_sync.formats.ipc_handles import dumps, loads, open_announced, share
from engines.weight_sync.formats.manifest import ParamSpec, dtype_name
from engines.weight_sync.probe import ProbeReference
from engines.weight_sync.protocol import (
    Received,
    SenderOptions,
    SyncReport,
    Transport,
    WorkerAnswer,
)
from engines.weight_sync.session import WeightSync
from engines.weight_sync.worker import WorkerWeights

logger = logging.getLogger(__name__)

#: The moments a sync's answer carries (`Phases.engines_reported`).
STAMPS = ("actor_in_at", "worker_in_at", "queued_at", "actor_out_at")


# --- trainer side --------------------------------------------------------------------------
class CudaIpcSender:
    """For engines on the trainer's own GPU(s): one copy per byte, no buffer;
    one control call per sync for one engine, two per engine for more (begin
    with the copy, then commit on all). With `wake_up`, engines put to sleep
    during training get their weights back first and their KV cache after.

    There is no copy in transit to verify (the engines read the trainer's own
    memory), so `SyncConfig.verify` does not apply; the report says so."""

    transport = "cuda_ipc"

    def __init__(
        self, config: SyncConfig | None = None, *, wake_up: bool = True, gather_handles: Any = None
    ):
        self.config = config or SyncConfig()
        self.wake_up = wake_up
        # Multi-rank trainers: a function from this rank's per-tensor handles
        # to all ranks' (e.g. all_gather_object, then merge_handles per tensor).
        self.gather_handles = gather_handles
        self.engines: list[Any] = []
        self._last_layout: tuple | None = None  # the layout of the last sync
        # (layout, mapping, bytes) of the tensors the engines keep
        self._held: tuple[tuple, str, int] | None = None
        self._manifests = ManifestCache()
        self._copy_events = CopyEvents()

    def init(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("no engines to sync")
        self.close()
        self.engines = as_engine_list(engines)

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.engines and self._held is not None:
            for result in call_engines(
                self.engines, "release_shared_weights", timeout_s=self.config.timeout_s
            ):
                if not result.ok:
                    logger.warning("engine %d: release failed: %s", result.engine, result.error)
        self._held = self._last_layout = None
        self._copy_events.clear()
        self.engines = []

    def _share(self, weights: list[tuple[str, Any]]) -> bytes:
        handles = [share(t) for _, t in weights]
        if self.gather_handles is not None:
            handles = self.gather_handles(handles)
        params = [[name, dtype_name(t.dtype), list(t.shape)] for name, t in weights]
        return dumps({"params": params, "handles": handles})

    def sync(
        self, weights: Weights, version: int, probe: ProbeReference | None = None
    ) -> SyncReport:
        import torch

        if not self.engines:
            raise WeightSyncError("call init(engines) before sync")
        phases = Phases()
        weights = list(weights)
        # One pass over the tensors: the sync's critical path at large models
        # is the way to the engines' copies, and Python per tensor is on it.
        layout = tuple((name, t.data_ptr(), t.dtype, t.shape, t.stride()) for name, t in weights)
        coordinator = Coordinator(self.engines, self.config, probe)
        held, self._held = self._held, None
        if held is not None and held[0] == layout:
            # The engines hold these very tensors, checked against their
            # manifests when they were opened: nothing to send or check again.
            (_, mapping, nbytes), shared, keep, manifest = held, None, True, None
        else:
            weights = trainer_weights(weights)
            if not all(t.is_cuda for _, t in weights):
                raise ValueError("CUDA IPC needs the trainer's weights on a GPU")
            manifest = self._manifests.of(weights)
            nbytes = manifest.nbytes
            # Tensors seen at the same places twice in a row are the trainer's
            # own (not temporaries): the engines keep those mapped. Keeping
            # temporaries would pin a copy of the model in the trainer's memory.
            mapping, shared = uuid.uuid4().hex, self._share(weights)
            keep = layout == self._last_layout
        self._last_layout = layout
        # The engines read the tensors themselves: the trainer's last writes
        # must have landed.
        torch.cuda.synchronize(weights[0][1].device)
        # Begin rides on the transfer call; one engine also commits in it. A
        # one-process trainer shares every engine worker's GPU, so it can wait
        # on the workers' copy events itself (`signal`).
        signal = self.gather_handles is None
        received = coordinator.begin_and_receive(
            version,
            manifest,
            "receive_shared_weights",
            (mapping, shared, keep, signal),
            wake=["weights"] if self.wake_up else None,
            wake_after=["kv_cache"] if self.wake_up else None,
        )
        phases.engines_reported(received, "pause_s", "open_s", "load_s", "call_s", *STAMPS)
        phases.done("transfer")
        events = [h for answer in received for h in answer.received.copies_done or ()]
        if events:
            # The engines answered with their copies queued: the sync is done
            # (and the trainer may write its tensors again) once they have run.
            try:
                self._copy_events.wait(events, weights[0][1].device, self.config.timeout_s)
            except WeightTransferError as exc:
                # Engines still open go stale (or restore); one that has
                # committed has a GPU that stopped copying, which its next
                # request or health check reports.
                coordinator.abort(str(exc))
                raise
            phases.done("copies")
        if keep:
            self._held = (layout, mapping, nbytes)
        else:
            torch.cuda.ipc_collect()  # free what the engines have let go
        if not received[0].committed:
            coordinator.finish(version, wake=["kv_cache"] if self.wake_up else None)
            phases.done("finish")
        return phases.report(
            version,
            self.transport,
            len(self.engines),
            nbytes=nbytes,
            verified=False,
            probe=coordinator.probe_result(),
        )


# --- engine actor --------------------------------------------------------------------------
async def receive_shared_weights(
    sync: WeightSync, mapping: str, shared: bytes | None, keep: bool, signal: bool = False
) -> Received:
    """Load the colocated trainer's weights straight from its GPU memory.
    `shared` carries the tensors' handles (`CudaIpcSender`), or is None to
    reuse the tensors of `mapping` that the workers kept from the last sync
    (`keep`). With `signal` (and `keep`) the workers answer before their
    copies finish: `copies_done` holds one CUDA event handle per worker for
    the trainer to wait on."""
    if shared is not None and not isinstance(shared, bytes):
        raise WeightSyncError(f"engine {sync.name}: shared handles must be bytes")
    return await sync.receive(
        "receive_shared_weights", str(mapping), shared, bool(keep), bool(signal)
    )


async def release_shared_weights(sync: WeightSync) -> None:
    """Drop the colocated trainer's tensors the workers kept between syncs,
    so the trainer can free that memory."""
    await sync.rpc("release_shared_weights")


# --- worker --------------------------------------------------------------------------------
def worker_receive_shared(
    worker: WorkerWeights, mapping: str, shared: bytes | None, keep: bool, signal: bool = False
) -> dict:
    """Load a colocated trainer's tensors straight from its memory: one copy,
    no buffer. `shared`: the pickled `{"params": [[name, dtype, shape], ...],
    "handles": [per-tensor handles]}` of `CudaIpcSender`, or None to reuse the
    tensors kept under `mapping` by the last sync. `signal` (with `keep`):
    answer once the copies are queued, with the handle of a CUDA event
    recorded after them; otherwise answer once they are done."""
    import torch

    started = time.monotonic()
    kept = worker.held.get("cuda_ipc")  # (mapping, [(name, tensor)], bytes)
    if shared is None:
        if kept is None or kept[0] != mapping:
            raise WeightTransferError(
                f"this worker does not hold the shared weights {mapping!r}; the trainer "
                "must send their handles again"
            )
        _, weights, nbytes = kept
    else:
        worker.held.pop("cuda_ipc", None)  # the trainer may free the old tensors now
        opened = loads(shared)
        specs = [ParamSpec(name=n, dtype=d, shape=s) for n, d, s in opened["params"]]
        problems = worker.problems_of(specs)
        if problems:
            return WorkerAnswer(problems=problems).plain()
        pairs = zip(specs, opened["handles"], strict=True)
        weights = [(spec.name, open_announced(worker, spec, h)) for spec, h in pairs]
        nbytes = sum(nbytes_of(t) for _, t in weights)
    opened_at = time.monotonic()
    # The mapping names the kept tensor objects: their copies' graph applies
    # again with no pass over them (CopyPlan.load).
    worker.load(weights, repeat=keep, token=mapping if keep else None)
    answer = WorkerAnswer(
        bytes=nbytes,
        # Nothing for end_weight_sync to do, unless a layerwise reload must finish.
        holds_sync_state=worker.reloading,
    )
    # A layerwise reload (models not proven for replay) still reads the
    # trainer's tensors when it finishes: no early answer then.
    if signal and keep and not worker.reloading:
        # Forward passes run on this thread's stream too, after the copies
        # queued here, so no request can read a half-copied weight. The
        # tensors stay mapped (`keep`) while the GPU still reads them.
        answer.copies_done = record_copies(worker.held, "cuda_ipc_event")
    else:
        # The trainer writes these tensors again (or frees them) once we return.
        torch.cuda.synchronize(worker.device)
    if keep:
        worker.held["cuda_ipc"] = (mapping, weights, nbytes)
    queued = time.monotonic()
    answer.times = {"open_s": opened_at - started, "load_s": queued - opened_at}
    # Moments on the host's one monotonic clock: the trainer shows them as
    # offsets into its sync (where the way in to the copies goes).
    answer.times.update(worker_in_at=started, queued_at=queued)
    return answer.plain()


def worker_release_shared(worker: WorkerWeights) -> None:
    worker.held.pop("cuda_ipc", None)


def new_sender(options: SenderOptions) -> CudaIpcSender:
    return CudaIpcSender(options.config)


TRANSPORT = Transport(
    "cuda_ipc",
    engine_methods={
        "receive_shared_weights": receive_shared_weights,
        "release_shared_weights": release_shared_weights,
    },
    worker_methods={
        "receive_shared_weights": worker_receive_shared,
        "release_shared_weights": worker_release_shared,
    },
    one_call=("receive_shared_weights",),
    new_sender=new_sender,
)
