"""Weight sync from a trainer to rollout engines: versioned, verified, and
bounded in time. Design: docs/weight_sync.md.

- `transports/`: one module per transport (trainer, engine-actor and worker
  sides): bucketed broadcast, CUDA IPC for colocated engines, checkpoints.
- `compat/`: the APIs of trainers written for others: OpenRLHF's, vLLM's native.
- `formats/`: what travels: manifests, buckets, checksums, copy plans, IPC
  handles, MoE layouts, the HF checkpoint layout, LoRA adapters and their store.
- `lora/`: LoRA adapters alone, a layer over three transports.
- Shared: `protocol` (types), `factory` (the transports by name, loaded
  lazily), `session` (the engine actor's), `worker` (each worker's),
  `coordinator` (a sync over a set of engines), `group`, `probe`, `config`.

Nothing here imports vLLM or CUDA at module level.
"""

from engines.weight_sync.config import GroupInfo, SyncConfig
from engines.weight_sync.errors import (
    ChecksumMismatchError,
    ManifestMismatchError,
    ProbeMismatchError,
    WeightSyncError,
    WeightTransferError,
    WeightVersionError,
)
from engines.weight_sync.factory import transport_for
from engines.weight_sync.formats.adapter import LoraSpec, LoraSync
from engines.weight_sync.formats.manifest import Manifest, ParamSpec
from engines.weight_sync.lora.sender import LoraSender
from engines.weight_sync.protocol import SyncReport
from engines.weight_sync.transports.broadcast import BroadcastSender
from engines.weight_sync.transports.checkpoint import CheckpointSender, sync_from_checkpoint
from engines.weight_sync.transports.cuda_ipc import CudaIpcSender

__all__ = [
    "BroadcastSender",
    "CheckpointSender",
    "ChecksumMismatchError",
    "CudaIpcSender",
    "GroupInfo",
    "LoraSender",
    "LoraSpec",
    "LoraSync",
    "Manifest",
    "ManifestMismatchError",
    "ParamSpec",
    "ProbeMismatchError",
    "SyncConfig",
    "SyncReport",
    "WeightSyncError",
    "WeightTransferError",
    "WeightVersionError",
    "sync_from_checkpoint",
    "transport_for",
]
