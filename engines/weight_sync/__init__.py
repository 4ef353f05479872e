"""Weight sync from a trainer to rollout engines, one module per transport
(trainer, engine-actor and worker sides together): bucketed collective
broadcast (`broadcast`), CUDA IPC for colocated engines (`cuda_ipc`),
safetensors checkpoints (`checkpoint`), OpenRLHF's per-parameter calls
(`openrlhf`), vLLM's native weight-transfer API (`vllm_native`) and
LoRA adapters alone (`lora`); the
protocol (`protocol`), the engine actor's session (`session`) and the
worker's state (`worker`) are shared. Versioned, verified, and bounded in
time. Design: docs/weight_sync.md.

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
from engines.weight_sync.formats.adapter import LoraSpec, LoraSync
from engines.weight_sync.formats.manifest import Manifest, ParamSpec
from engines.weight_sync.lora import LoraSender
from engines.weight_sync.protocol import SyncReport, transport_for
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
