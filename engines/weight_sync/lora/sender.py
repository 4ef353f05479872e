"""The trainer side of a LoRA adapter's sync (`LoraSender`), `via` one of
`formats.adapter.VIAS`: the way the trainer's full-weight transport moves
bytes (`VIA_OF_TRANSPORT`)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from engines.weight_sync.config import SyncConfig
from engines.weight_sync.coordinator import (
    Coordinator,
    ManifestCache,
    Phases,
    as_engine_list,
    trainer_weights,
)
from engines.weight_sync.errors import WeightSyncError, WeightTransferError
from engines.weight_sync.formats import ipc_handles as ipc
from engines.weight_sync.formats.adapter import VIAS, LoraSync, save_adapter
from engines.weight_sync.formats.buckets import ALIGN, PackedViews, plan_buckets
from engines.weight_sync.formats.copy_events import CopyEvents
from engines.weight_sync.probe import ProbeResult
from engines.weight_sync.protocol import SenderOptions, SyncReport

logger = logging.getLogger(__name__)

#: The parts of a worker's `load_s` its answer times (`lora.worker.worker_load`,
#: `AdapterStore.times`), carried into the report's `engine_times`.
LOAD_PARTS = ("check_s", "remove_s", "refill_s", "build_s", "add_s")
#: The moments a CUDA IPC sync's answer carries (`Phases.engines_reported`):
#: the call into the engine actor, its worker, the copy queued, the actor's
#: receive and commit done.
STAMPS = ("actor_in_at", "worker_in_at", "queued_at", "received_at", "actor_out_at")
#: The trainer's full-weight transport -> how its adapter travels instead.
VIA_OF_TRANSPORT = {"cuda_ipc": "cuda_ipc", "checkpoint": "checkpoint", "broadcast": "inline"}


class LoraSender:
    """Sends an adapter (not the model) at every sync, `via` one of `VIAS`;
    one call per engine (begin, receive and, for one engine, commit)."""

    def __init__(
        self, via: str, lora: LoraSync, config: SyncConfig, checkpoint_dir: str | None = None
    ):
        if via not in VIAS:
            raise ValueError(f"via must be one of {VIAS}, got {via!r}")
        if via == "checkpoint" and checkpoint_dir is None:
            raise ValueError("via 'checkpoint' needs a checkpoint_dir")
        self.via, self.lora, self.config = via, lora, config
        self.checkpoint_dir = checkpoint_dir
        self.transport = f"lora-{via}"
        self.engines: list[Any] = []
        # cuda_ipc: (manifest, packed buffer) the engines keep mapped, and its name.
        self._manifests = ManifestCache()
        self._checked: Any = None  # the manifest whose tensors check_tensors passed
        self._packed: tuple[Any, PackedViews] | None = None
        self._mapping: str | None = None
        self._mapped = False
        # The engines' copies out of the buffer, still to be waited on before
        # it is written again (their answers come with the copies queued).
        self._copies: list[bytes] = []
        self._copy_events = CopyEvents()

    def init(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("no engines to sync")
        self.close()
        self.engines = as_engine_list(engines)

    def summary(self) -> dict[str, Any]:
        return {"lora": self.lora.spec.plain(), "keep": self.lora.keep, "via": self.via}

    def close(self) -> None:
        try:
            self._copies_read()
        except WeightTransferError as exc:
            # An engine that died mid-copy: nothing reads the buffer any more.
            logger.warning("closing the LoRA sender: %s", exc)
        if self.engines and self._mapped:
            from engines.client import call_engines

            call_engines(self.engines, "release_lora_buffer", timeout_s=self.config.timeout_s)
        self._packed = self._mapping = None
        self._mapped = False
        self._copy_events.clear()
        self.engines = []

    def _copies_read(self) -> None:
        """Wait until the engines have copied the buffer out (at the next
        sync this is long done: the wait is one query per engine)."""
        if self._copies and self._packed is not None:
            device = self._packed[1].buffer.device
            copies, self._copies = self._copies, []
            self._copy_events.wait(copies, device, self.config.timeout_s)

    def _payload(self, weights: list[tuple[str, Any]], version: int, manifest: Any) -> Any:
        if self.via == "inline":
            from safetensors.torch import save

            return save({n: t.contiguous().cpu() for n, t in weights})
        if self.via == "checkpoint":
            return str(
                save_adapter(
                    weights, self.lora.spec, Path(self.checkpoint_dir, f"lora-v{version:06d}")
                )
            )
        return self._pack(weights, manifest)

    def _pack(self, weights: list[tuple[str, Any]], manifest: Any) -> bytes:
        """One buffer of every tensor (a broadcast bucket's layout), kept
        across syncs with its views (`PackedViews`): the engines map it once,
        so a later sync sends only its name and opens nothing, and packing
        is one fused copy."""
        import torch

        if not all(t.is_cuda for _, t in weights):
            raise ValueError("CUDA IPC sends an adapter on a GPU")
        self._copies_read()  # before the buffer is written again, or dropped
        if self._packed is None or self._packed[0] is not manifest:
            room = manifest.nbytes + ALIGN * len(manifest.params)  # one bucket
            (bucket,) = plan_buckets(manifest, room).buckets
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=weights[0][1].device)
            self._packed = (manifest, PackedViews(bucket, buffer))
            self._mapping, self._mapped = uuid.uuid4().hex, False
        # The manifest is the cache's while names, dtypes and shapes stay:
        # the views fit the tensors.
        packed = self._packed[1]
        packed.pack([t for _, t in weights])
        torch.cuda.synchronize(packed.buffer.device)  # the engines read it from another process
        if self._mapped:
            return ipc.dumps({"mapping": self._mapping, "handles": None, "bucket": None})
        layout = packed.bucket.model_dump(mode="json")
        handles = ipc.share(packed.buffer)
        return ipc.dumps({"mapping": self._mapping, "handles": handles, "bucket": layout})

    def sync(self, weights: Any, version: int, probe: Any = None) -> SyncReport:
        # `probe` is not run: an adapter version is served from its commit
        # on, after the point where the engines run the probe.
        if not self.engines:
            raise WeightSyncError("call init(engines) before sync")
        phases = Phases()
        weights = trainer_weights(weights)
        manifest = self._manifests.of(weights)
        if manifest is not self._checked:  # the same names and shapes passed before
            self.lora.spec.check_tensors(weights)
            self._checked = manifest
        payload = self._payload(weights, version, manifest)
        phases.done("pack")
        wake = self.via == "cuda_ipc"  # colocated engines may sleep during training
        coordinator = Coordinator(self.engines, self.config)
        self._mapped = False  # the engines drop the buffer if the sync fails
        args = (version, self.lora.spec.plain(), self.via, payload, self.lora.keep)
        received = coordinator.begin_and_receive(
            version,
            None,
            "receive_lora_adapter",
            args,
            wake=["weights"] if wake else None,
            wake_after=["kv_cache"] if wake else None,
        )
        self._mapped = self.via == "cuda_ipc"
        self._copies = [h for answer in received for h in answer.received.copies_done or ()]
        # Moments compare clocks: only colocated engines (CUDA IPC) share the trainer's.
        stamps = STAMPS if wake else ()
        phases.engines_reported(received, "pause_s", "open_s", "load_s", "call_s", *stamps)
        phases.engines_reported(received, *LOAD_PARTS)
        phases.done("transfer")
        if not received[0].committed:
            coordinator.finish(version, wake=["kv_cache"] if wake else None)
            phases.done("finish")
        nbytes = manifest.nbytes
        skipped = ProbeResult("skipped", note="adapter syncs are not probed")
        return phases.report(
            version, self.transport, len(self.engines), nbytes=nbytes, verified=False, probe=skipped
        )


def new_sender(transport: str, options: SenderOptions) -> LoraSender:
    """The adapter's sender in place of `transport`'s (the trainer's placement)."""
    if transport not in VIA_OF_TRANSPORT:
        raise ValueError(
            f"a LoRA adapter syncs over one of {tuple(VIA_OF_TRANSPORT)}, not {transport!r}"
        )
    return LoraSender(
        VIA_OF_TRANSPORT[transport], options.lora, options.config, options.checkpoint_dir
    )
