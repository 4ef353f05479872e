"""Transport: a checkpoint directory in the HF layout (safetensors), for
trainers outside the cluster, which write a directory the engines can read.

The directory's layout (`save`, `read_manifest`, `iter_tensors`):
`formats/hf_checkpoint.py`.

Trainer: `CheckpointSender` (`save`, then `sync_from_checkpoint(engines,
path)`: two-phase; begin rides on the load call, and a single engine without
`verify` commits in it too). Engine actor: `load_weights_from_path`,
`load_checkpoint` (one engine, by itself). Worker: `load_weights_from_path`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from engines.weight_sync.config import SyncConfig
from engines.weight_sync.coordinator import Coordinator, Phases, as_engine_list
from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats.checksum import checksums, nbytes_of
from engines.weight_sync.formats.hf_checkpoint import (
    iter_tensors,
    read_manifest,
    read_version,
    save,
)
from engines.weight_sync.probe import ProbeReference
from engines.weight_sync.protocol import (
    Committed,
    Received,
    SenderOptions,
    SyncReport,
    Transport,
    WorkerAnswer,
)
from engines.weight_sync.session import WeightSync
from engines.weight_sync.worker import WorkerWeights


# --- trainer side --------------------------------------------------------------------------
def sync_from_checkpoint(
    engines: list[Any],
    path: str,
    version: int | None = None,
    config: SyncConfig | None = None,
    probe: ProbeReference | None = None,
) -> SyncReport:
    """Engines load a safetensors checkpoint directory (HF layout) that a
    trainer outside the cluster wrote (`save`); two-phase like the other
    transports. The version is `version`, else the one stored in the checkpoint."""
    config = config or SyncConfig()
    manifest = read_manifest(path)
    if version is None:
        version = read_version(path)
        if version is None:
            raise WeightSyncError(f"{path} stores no weight version; pass version=")
    coordinator = Coordinator(engines, config, probe)
    phases = Phases()
    received = coordinator.begin_and_receive(
        version,
        manifest,
        "load_weights_from_path",
        (str(path), config.verify),
        verified=config.verify,
    )
    phases.engines_reported(received, "pause_s", "call_s")
    phases.done("transfer")
    if config.verify:
        coordinator.check_received(version, checksums(iter_tensors(path)), received)
        phases.done("verify")
    if not received[0].committed:
        coordinator.finish(version)
        phases.done("finish")
    return phases.report(
        version,
        "checkpoint",
        len(engines),
        nbytes=manifest.nbytes,
        verified=config.verify,
        probe=coordinator.probe_result(),
    )


class CheckpointSender:
    """For a trainer that hands its weights over as a directory the engines
    can read: each sync writes `<directory>/v<version>` (`save`) and the
    engines load it (`sync_from_checkpoint`)."""

    transport = "checkpoint"

    def __init__(self, config: SyncConfig | None = None, *, directory: str):
        self.config = config or SyncConfig()
        self.directory = directory
        self.engines: list[Any] = []

    def init(self, engines: list[Any]) -> None:
        # Nothing to connect: the engines read the directory at each sync.
        self.engines = as_engine_list(engines)

    def summary(self) -> dict[str, Any]:
        return {}

    def sync(
        self,
        weights: Iterable[tuple[str, Any]],
        version: int,
        probe: ProbeReference | None = None,
    ) -> SyncReport:
        path = os.path.join(self.directory, f"v{version:06d}")
        save(weights, path, version=version)
        return sync_from_checkpoint(self.engines, path, version, self.config, probe)

    def close(self) -> None:
        self.engines = []


def new_sender(options: SenderOptions) -> CheckpointSender:
    if not options.checkpoint_dir:
        raise ValueError("transport 'checkpoint' needs checkpoint_dir")
    return CheckpointSender(options.config, directory=options.checkpoint_dir)


# --- engine actor --------------------------------------------------------------------------
async def load_weights_from_path(sync: WeightSync, path: str, verify: bool = True) -> Received:
    """Load a safetensors checkpoint directory (HF layout) into the open sync."""
    return await sync.receive("load_weights_from_path", str(path), bool(verify))


async def load_checkpoint(
    sync: WeightSync,
    path: str,
    version: int | None = None,
    *,
    on_failure: str = "restore",
    verify: bool = True,
) -> Committed:
    """Begin, load `path`, finish - on this engine alone (several engines at
    once: `sync_from_checkpoint`)."""
    if version is None:
        version = read_version(path) or sync.host.weight_version + 1
    manifest = read_manifest(path).model_dump(mode="json")
    await sync.begin_weight_sync(version, manifest, on_failure=on_failure, allow_partial=True)
    await load_weights_from_path(sync, path, verify=verify)
    return await sync.finish_weight_sync(version)


# --- worker --------------------------------------------------------------------------------
def worker_load_path(worker: WorkerWeights, path: str, verify: bool = True) -> dict:
    """Load every weight of a safetensors checkpoint (HF layout)."""
    started = time.monotonic()
    nbytes = 0
    for name, tensor in iter_tensors(path, device="cpu"):
        weight = tensor.to(worker.device)
        if verify:
            worker.record_wire([(name, weight)])
        worker.load([(name, weight)])
        nbytes += nbytes_of(tensor)
    worker.empty_cache()
    return worker.answer(
        WorkerAnswer(bytes=nbytes, times={"load_s": time.monotonic() - started}), verify
    )


TRANSPORT = Transport(
    "checkpoint",
    engine_methods={
        "load_weights_from_path": load_weights_from_path,
        "load_checkpoint": load_checkpoint,
    },
    worker_methods={"load_weights_from_path": worker_load_path},
    one_call=("load_weights_from_path",),
    new_sender=new_sender,
)
