"""The engine actor's weights outside a sync (`EngineWeights`, the base of
`session.WeightSync`): calls to its workers, the manifest it accepts, reading
its weights back, and its workers' place in a trainer's weight group.
"""

from __future__ import annotations

from typing import Any

from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats.manifest import Manifest, raise_problems
from engines.weight_sync.protocol import EngineHost


class EngineWeights:
    """What an engine actor's weight sync needs between syncs: its host's
    workers (`rpc`), the manifests it accepted, and whether its workers are
    in a weight group."""

    def __init__(self, host: EngineHost):
        self.host = host
        self.in_group = False  # set by init_process_group, cleared by destroy_weight_group
        # Per transport, what it keeps between syncs (a validated plan).
        self.held: dict[str, Any] = {}
        self._accepted: frozenset[tuple[str, bool]] = frozenset()
        self._last_accepted: tuple[dict, bool] | None = None

    @property
    def name(self) -> str:
        return self.host.config.name

    def rpc_timeout(self, timeout_s: float | None = None) -> float:
        return float(timeout_s) if timeout_s is not None else float(self.host.config.rpc_timeout_s)

    async def rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return await self.host.collective_rpc(method, args=args, kwargs=kwargs or None)

    # --- manifest and inspection -------------------------------------------------------
    async def weight_manifest(self) -> dict:
        """The parameter layout (HF names) this engine accepts."""
        return (await self.rpc("weight_manifest"))[0]

    async def check_weight_manifest(self, manifest: dict, allow_partial: bool = False) -> None:
        """Raise ManifestMismatchError, naming the parameter, if the trainer's
        manifest does not fit this engine. Changes nothing."""
        # Most syncs send the manifest accepted last time: a plain comparison,
        # no validation.
        if self._last_accepted == (manifest, bool(allow_partial)):
            return
        checked = Manifest.model_validate(manifest)
        # A worker's layout never changes, so a manifest it accepted once is
        # accepted again without asking it.
        key = (checked.digest(), bool(allow_partial))
        if key not in self._accepted:
            per_worker = await self.rpc(
                "weight_manifest_problems", checked.model_dump(mode="json"), bool(allow_partial)
            )
            raise_problems(self.name, [p for problems in per_worker for p in problems])
            self._accepted = self._accepted | {key}
        self._last_accepted = (manifest, bool(allow_partial))

    async def weight_checksums(self, names: list[str]) -> list[dict[str, str | None]]:
        """Per worker: checksums of the named weights (see WorkerWeights)."""
        return await self.rpc("weight_checksums", list(names))

    async def read_weights(self, names: list[str]) -> dict[str, Any]:
        """Rank 0's copies of the named weights (CPU tensors)."""
        return (await self.rpc("read_weights", list(names)))[0]

    # --- the weight group --------------------------------------------------------------
    async def init_process_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        use_ray: bool = False,
        timeout_s: float | None = None,
        secret: str | None = None,
    ) -> list[int]:
        """Join the trainer's weight group (OpenRLHF's signature): worker of
        tensor-parallel rank r becomes rank `rank_offset + r`. Must run while the
        trainer (rank 0) creates its side. Returns the ranks taken. `secret`:
        the group's (our trainer's); OpenRLHF's trainers send none."""
        if use_ray:
            # ray.util.collective has no timeout on its collectives, and every
            # collective here must have one.
            raise WeightSyncError("use_ray=True is not supported: use backend 'gloo' or 'nccl'")
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 1:
            raise WeightSyncError(
                f"rank_offset must be an integer >= 1 (0 is the trainer), got {rank_offset!r}"
            )
        ranks = await self.rpc(
            "init_process_group",
            master_address=str(master_address),
            master_port=int(master_port),
            rank_offset=rank_offset,
            world_size=int(world_size),
            group_name=str(group_name),
            backend=backend,
            timeout_s=self.rpc_timeout(timeout_s),
            secret=secret,
        )
        self.in_group = True
        return ranks

    async def destroy_weight_group(self) -> None:
        self.in_group = False
        await self.rpc("destroy_weight_group")

    async def has_weight_group(self) -> bool:
        return all(await self.rpc("has_weight_group"))

    async def weight_worker_nodes(self) -> list[str]:
        """The node address of each worker (one rank each in a weight group:
        as many as the tensor-parallel size)."""
        return await self.rpc("node_address")
