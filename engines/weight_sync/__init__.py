"""Weight sync from a trainer to rollout engines: bucketed collective
broadcast (gloo / NCCL), CUDA IPC for colocated engines, and safetensors
checkpoints; versioned, verified, and bounded in time. Design: docs/weight_sync.md.

Nothing here imports vLLM or CUDA at module level.
"""

from engines.weight_sync.config import GroupInfo, SyncConfig
from engines.weight_sync.coordinator import SyncReport
from engines.weight_sync.errors import (
    ChecksumMismatchError,
    ManifestMismatchError,
    WeightSyncError,
    WeightTransferError,
    WeightVersionError,
)
from engines.weight_sync.manifest import Manifest, ParamSpec
from engines.weight_sync.senders import BroadcastSender, CudaIpcSender, sync_from_checkpoint

__all__ = [
    "BroadcastSender",
    "ChecksumMismatchError",
    "CudaIpcSender",
    "GroupInfo",
    "Manifest",
    "ManifestMismatchError",
    "ParamSpec",
    "SyncConfig",
    "SyncReport",
    "WeightSyncError",
    "WeightTransferError",
    "WeightVersionError",
    "sync_from_checkpoint",
]
