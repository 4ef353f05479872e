"""A worker's place in a trainer's weight group (`WorkerGroup`, between
`worker_manifest.WorkerManifest` and `worker.WorkerWeights`): joining it as
OpenRLHF's workers do, leaving it, and receiving one broadcast tensor
(the broadcasting transports: ours, OpenRLHF's, vLLM's native API).
"""

from __future__ import annotations

from typing import Any

from engines.weight_sync.config import GroupInfo
from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.formats.manifest import ParamSpec, torch_dtype
from engines.weight_sync.group import WeightGroup
from engines.weight_sync.worker_manifest import WorkerManifest


class WorkerGroup(WorkerManifest):
    """The weight group this worker is in, if any (a failed sync tears it down)."""

    def __init__(self, host: Any):
        super().__init__(host)
        self.group: WeightGroup | None = None

    def init_process_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        timeout_s: float = 60.0,
        secret: str | None = None,
    ) -> int:
        """Join the trainer's group as rank `rank_offset + rank` (OpenRLHF's
        WorkerWrap.init_process_group); returns that rank."""
        self.destroy_weight_group()
        info = GroupInfo(
            master_address,
            int(master_port),
            int(world_size),
            group_name,
            backend,
            float(timeout_s),
            secret,
        )
        rank = int(rank_offset) + int(self.host.rank)
        self.group = WeightGroup(info, rank, device=self.device)
        return rank

    def destroy_weight_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def has_weight_group(self) -> bool:
        return self.group is not None and self.group.alive

    def node_address(self) -> str:
        """This worker's node address (the trainer listens on loopback when all share it)."""
        from ray.util import get_node_ip_address

        return get_node_ip_address()

    def weight_group_id(self) -> str | None:
        return self.group.group_id if self.has_weight_group() else None

    def live_group(self) -> WeightGroup:
        if self.group is None or not self.group.alive:
            raise WeightTransferError(
                "no weight group on this worker: call init_process_group first (a failed "
                "sync tears the group down)"
            )
        return self.group

    def receive_one(self, spec: ParamSpec) -> tuple[Any, list[str]]:
        """One tensor broadcast from rank 0, and its manifest problems. It is
        received before it is checked, so a bad name does not leave the
        trainer hanging in the collective; a bad one must not be loaded."""
        import torch

        weight = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
        self.live_group().broadcast(weight, src=0)
        return weight, self.problems_of([spec])
