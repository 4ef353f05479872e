"""Trainer-side senders, one per transport, with one lifecycle:
`init(engines)` -> `sync(weights, version)` (as often as needed) -> `close()`.

`weights` is a sequence of (HF name, tensor), e.g. `list(model.named_parameters())`.
Each `sync` is two-phase over all engines (see `coordinator`): a failure
anywhere aborts the sync everywhere, and raises `WeightSyncError` (recoverable;
the broadcast group is rebuilt on the next sync) or `EngineDeadError`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from engines.client import call_engines, raise_first_error
from engines.weight_sync import checkpoint, cuda_ipc
from engines.weight_sync.broadcast import WeightGroup, free_port
from engines.weight_sync.buckets import (
    BucketPlan,
    bucket_key,
    iter_buckets,
    pack_bucket,
    plan_buckets,
)
from engines.weight_sync.checksum import checksums, device_sums, finish_checksums
from engines.weight_sync.config import DEFAULT_GROUP_NAME, GroupInfo, SyncConfig
from engines.weight_sync.coordinator import Coordinator, Phases, SyncReport, as_engine_list
from engines.weight_sync.errors import WeightSyncError, WeightTransferError
from engines.weight_sync.manifest import Manifest, dtype_name

logger = logging.getLogger(__name__)

Weights = Sequence[tuple[str, Any]]


class ManifestCache:
    """The manifest of the last weights seen, made again only when their
    names, dtypes or shapes change (most syncs send the same layout; making
    it costs a millisecond at 7B)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._manifest: Manifest | None = None

    def of(self, weights: list[tuple[str, Any]]) -> Manifest:
        key = tuple((name, t.dtype, tuple(t.shape)) for name, t in weights)
        if key != self._key:
            self._key, self._manifest = key, Manifest.of(weights)
        return self._manifest


def _weights(weights: Any) -> list[tuple[str, Any]]:
    weights = list(weights)
    if not weights:
        raise ValueError("no weights to sync")
    return [(name, t.detach()) for name, t in weights]


class BroadcastSender:
    """Rank 0 of a process group with every engine worker: gloo on CPU, NCCL
    on GPU. Parameters travel in flat buckets of `config.bucket_bytes`, with
    one control call per engine per sync."""

    transport = "broadcast"

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP_NAME,
        master_address: str | None = None,
        device: Any = "cpu",
    ):
        self.config = config or SyncConfig()
        self.backend = backend
        self.group_name = group_name
        self.master_address = master_address
        self.device = device
        self.engines: list[Any] = []
        self.group: WeightGroup | None = None
        self.info: GroupInfo | None = None
        self._manifests = ManifestCache()
        self._plan: tuple[tuple, BucketPlan, dict] | None = None

    # --- lifecycle -----------------------------------------------------------------------
    def init(self, engines: list[Any]) -> GroupInfo:
        """Build the group with `engines` (replacing any earlier group)."""
        import ray

        if not engines:
            raise ValueError("no engines to sync")
        self.close()
        self.engines = as_engine_list(engines)
        timeout = self.config.timeout_s
        sizes = raise_first_error(
            call_engines(self.engines, "num_weight_workers", timeout_s=timeout)
        )
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        address = self.master_address or ray.util.get_node_ip_address()
        info = GroupInfo(
            address, free_port(), 1 + sum(sizes), self.group_name, self.backend, timeout
        )
        refs = [
            engine.init_process_group.remote(
                info.master_address,
                info.master_port,
                offset,
                info.world_size,
                info.group_name,
                info.backend,
                False,
                timeout,
            )
            for engine, offset in zip(self.engines, offsets, strict=True)
        ]
        try:
            group = WeightGroup(info, rank=0, device=self.device)
        except WeightSyncError:
            for ref in refs:
                ray.cancel(ref, force=False)
            raise
        try:
            Coordinator(self.engines, self.config).collect(refs, "join the weight group")
        except BaseException:
            group.destroy()
            raise
        self.group, self.info = group, info
        logger.info(
            "weight group %s:%d ready: %d engines, world %d",
            address,
            info.master_port,
            len(self.engines),
            info.world_size,
        )
        return info

    def close(self) -> None:
        """Tear the group down on both sides (best effort on the engines)."""
        if self.group is not None:
            self.group.destroy()
            self.group = None
        if self.engines:
            for result in call_engines(
                self.engines, "destroy_weight_group", timeout_s=self.config.timeout_s
            ):
                if not result.ok:
                    logger.warning(
                        "engine %d: leaving the weight group failed: %s",
                        result.engine,
                        result.error,
                    )

    def bucket_plan(self, manifest: Manifest) -> tuple[BucketPlan, dict]:
        """The buckets of `manifest` and their plain form, made again only
        when the manifest or the bucket size changes."""
        key = (manifest, self.config.bucket_bytes)
        if self._plan is None or self._plan[0] != key:
            plan = plan_buckets(manifest, self.config.bucket_bytes)
            self._plan = (key, plan, plan.model_dump(mode="json"))
        return self._plan[1], self._plan[2]

    def _group_intact(self, begun: list[dict]) -> bool:
        """Our group is up, and every engine worker is still in it (a failed
        sync tears groups down; another trainer may have taken the engines):
        from the engines' answers to begin."""
        if self.group is None or not self.group.alive:
            logger.info("weight group is down: rebuilding it")
            return False
        if any(i != self.group.group_id for answer in begun for i in answer["group_ids"]):
            logger.warning("engines left weight group %s: rebuilding it", self.group.group_id)
            return False
        return True

    # --- one sync ----------------------------------------------------------------------------
    def sync(self, weights: Weights, version: int) -> SyncReport:
        """Push `weights` as `version` to every engine: `start`, send every
        bucket, `finish`."""
        transfer = self.start(weights, version)
        transfer.send()
        return transfer.finish()

    def start(self, weights: Weights, version: int) -> BroadcastTransfer:
        """Check the manifest on every engine, open the sync (engines pause),
        and have them wait for the buckets. Rebuilds the group if a failed
        sync tore it down."""
        if not self.engines:
            raise WeightSyncError("call init(engines) before sync")
        weights = _weights(weights)
        manifest = self._manifests.of(weights)
        coordinator = Coordinator(self.engines, self.config)
        phases = Phases()
        begun = coordinator.begin(version, manifest)
        if not self._group_intact(begun):
            # Rare (after a failure): leave the engines as they were, rebuild,
            # and open the sync again.
            coordinator.abort("rebuilding the weight group")
            self.init(self.engines)
            begun = coordinator.begin(version, manifest)
        phases.engines_reported(begun, "pause_s", "prepare_s")
        phases.done("begin")
        return BroadcastTransfer(self, coordinator, weights, manifest, version, phases)


class BroadcastTransfer:
    """One sync in flight (from `BroadcastSender.start`): `send` the buckets,
    then `finish`. Any failure aborts the sync on every engine and raises."""

    def __init__(
        self,
        sender: BroadcastSender,
        coordinator: Coordinator,
        weights: list,
        manifest: Manifest,
        version: int,
        phases: Phases,
    ):
        import torch

        self.sender, self.coordinator, self.version, self.phases = (
            sender,
            coordinator,
            version,
            phases,
        )
        self.manifest = manifest
        self.plan, plan = sender.bucket_plan(manifest)
        self.sent = 0
        self._buckets = iter_buckets(self.plan, weights)
        # Two buffers take turns: bucket k+1 is packed while bucket k is on
        # the wire (the engines load one while receiving the next the same way).
        size = max(b.nbytes for b in self.plan.buckets)
        self._buffers = [
            torch.empty(size, dtype=torch.uint8, device=sender.device)
            for _ in range(min(2, len(self.plan.buckets)))
        ]
        self._in_flight = None
        # Per bucket: (bytes, checksum sums on the device) of what was packed.
        self._sums: dict[str, tuple[int, Any]] = {}
        self._refs = [
            e.receive_weight_buckets.remote(plan, sender.config.verify) for e in sender.engines
        ]

    @property
    def remaining(self) -> int:
        return len(self.plan.buckets) - self.sent

    def send(self, buckets: int | None = None) -> int:
        """Broadcast the next `buckets` buckets (default: all left); returns
        how many were sent."""
        count = self.remaining if buckets is None else min(buckets, self.remaining)
        try:
            group = self.sender.group
            for _ in range(count):
                bucket, tensors = next(self._buckets)
                buffer = self._buffers[self.sent % len(self._buffers)]
                # This buffer's last broadcast was waited for below, one
                # bucket ago: packing may overwrite it.
                flat = pack_bucket(bucket, tensors, out=buffer[: bucket.nbytes])
                if self.sender.config.verify:
                    # Queued before the broadcast and before the buffer's reuse.
                    self._sums[bucket_key(self.sent)] = (bucket.nbytes, device_sums(flat))
                started = group.start_broadcast(flat, src=0)
                group.wait(self._in_flight)
                self._in_flight = started
                self.sent += 1
            if not self.remaining:
                group.wait(self._in_flight)
                self._in_flight = None
        except Exception as exc:
            # Tear the group down (a failed broadcast already did), so the
            # engines' receives fail now instead of at their deadline; learn
            # which engines are dead (that error wins), then abort the rest.
            if self.sender.group is not None:
                self.sender.group.destroy()
            try:
                self.coordinator.collect(self._refs, f"receive version {self.version}")
            except Exception as engine_error:  # noqa: BLE001 - the more specific error
                raise engine_error from exc
            self.coordinator.abort(str(exc))
            raise
        return count

    def finish(self) -> SyncReport:
        """Wait for every engine to load, verify, commit the new version."""
        if self.remaining:
            self.coordinator.abort(f"finish called with {self.remaining} buckets unsent")
            raise WeightSyncError(f"{self.remaining} buckets were not sent; the sync was aborted")
        config = self.sender.config
        expected = finish_checksums(self._sums) if config.verify else None
        received = self.coordinator.collect(self._refs, f"receive version {self.version}")
        self.phases.engines_reported(received, "wait_s", "load_s")
        self.phases.done("transfer")
        if expected is not None:
            self.coordinator.check_received(self.version, expected, received)
            self.phases.done("verify")
        self.coordinator.finish(self.version)
        self.phases.done("finish")
        return SyncReport(
            self.version,
            self.sender.transport,
            len(self.sender.engines),
            bytes=self.manifest.nbytes,
            buckets=len(self.plan.buckets),
            seconds=self.phases.total,
            verified=config.verify,
            phases=self.phases.times,
            engine_times=self.phases.engine_times,
        )


class CudaIpcSender:
    """For engines on the trainer's own GPU(s): the engines copy the weights
    straight out of the trainer's tensors, opened by CUDA IPC handle (no NCCL:
    one GPU cannot hold two NCCL ranks). One copy per byte, no buffer; one
    control call per sync for one engine, two per engine for more (begin
    with the copy, then commit on all). While the trainer's tensors stay
    where they are (parameters updated in place), the engines keep them
    mapped, later syncs send no handles at all, and the engines replay their
    copies as one CUDA graph; from a one-process trainer they answer as soon
    as the copies are queued, and the trainer waits on their CUDA events (the
    answer travels back while the GPU copies). With `wake_up`, engines put to
    sleep during training get their weights back first and their KV cache after.

    There is no copy in transit to verify (the engines read the trainer's own
    memory), so `SyncConfig.verify` does not apply; the report says so."""

    transport = "cuda_ipc"

    def __init__(
        self, config: SyncConfig | None = None, *, wake_up: bool = True, gather_handles: Any = None
    ):
        self.config = config or SyncConfig()
        self.wake_up = wake_up
        # Multi-rank trainers: a function from this rank's per-tensor handles
        # to all ranks' (e.g. all_gather_object, then cuda_ipc.merge_handles
        # per tensor).
        self.gather_handles = gather_handles
        self.engines: list[Any] = []
        self._last_layout: tuple | None = None  # the layout of the last sync
        self._held: tuple[tuple, str] | None = None  # (layout, mapping) the engines keep
        self._manifests = ManifestCache()
        self._copy_events = cuda_ipc.CopyEvents()

    def init(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("no engines to sync")
        self.close()
        self.engines = as_engine_list(engines)

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
        handles = [cuda_ipc.share(t) for _, t in weights]
        if self.gather_handles is not None:
            handles = self.gather_handles(handles)
        params = [[name, dtype_name(t.dtype), list(t.shape)] for name, t in weights]
        return cuda_ipc.dumps({"params": params, "handles": handles})

    def sync(self, weights: Weights, version: int) -> SyncReport:
        import torch

        if not self.engines:
            raise WeightSyncError("call init(engines) before sync")
        weights = _weights(weights)
        if not all(t.is_cuda for _, t in weights):
            raise ValueError("CUDA IPC needs the trainer's weights on a GPU")
        manifest = self._manifests.of(weights)
        layout = tuple((name, t.data_ptr(), t.dtype, t.shape, t.stride()) for name, t in weights)
        coordinator = Coordinator(self.engines, self.config)
        phases = Phases()
        held, self._held = self._held, None
        # The engines read the tensors themselves: the trainer's last writes
        # must have landed.
        torch.cuda.synchronize(weights[0][1].device)
        if held is not None and held[0] == layout:
            mapping, shared, keep = held[1], None, True
        else:
            # Tensors seen at the same places twice in a row are the trainer's
            # own (not temporaries): the engines keep those mapped. Keeping
            # temporaries would pin a copy of the model in the trainer's memory.
            mapping, shared = uuid.uuid4().hex, self._share(weights)
            keep = layout == self._last_layout
        self._last_layout = layout
        # Begin rides on the transfer call (the engines need nothing from the
        # trainer in between); one engine also commits in it. Engines put to
        # sleep during training get their weights back first and their KV
        # cache last. A one-process trainer shares every engine worker's GPU,
        # so it can wait on the workers' copy events itself (`signal`).
        signal = self.gather_handles is None
        received = coordinator.begin_and_receive(
            version,
            manifest,
            "receive_shared_weights",
            (mapping, shared, keep, signal),
            wake=["weights"] if self.wake_up else None,
            wake_after=["kv_cache"] if self.wake_up else None,
        )
        phases.engines_reported(received, "pause_s", "open_s", "load_s", "call_s")
        phases.done("transfer")
        events = [handle for answer in received for handle in answer.get("copies_done", [])]
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
            self._held = (layout, mapping)
        else:
            torch.cuda.ipc_collect()  # free what the engines have let go
        if not received[0]["committed"]:
            coordinator.finish(version, wake=["kv_cache"] if self.wake_up else None)
            phases.done("finish")
        return SyncReport(
            version,
            self.transport,
            len(self.engines),
            bytes=manifest.nbytes,
            buckets=0,
            seconds=phases.total,
            verified=False,
            phases=phases.times,
            engine_times=phases.engine_times,
        )


def sync_from_checkpoint(
    engines: list[Any], path: str, version: int | None = None, config: SyncConfig | None = None
) -> SyncReport:
    """Engines load a safetensors checkpoint directory (HF layout) that a
    trainer outside the cluster wrote (`checkpoint.save`); two-phase like the
    other transports. The version is `version`, else the one stored in the
    checkpoint."""
    config = config or SyncConfig()
    manifest = checkpoint.read_manifest(path)
    if version is None:
        version = checkpoint.read_version(path)
        if version is None:
            raise WeightSyncError(f"{path} stores no weight version; pass version=")
    coordinator = Coordinator(engines, config)
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
        coordinator.check_received(version, checksums(checkpoint.iter_tensors(path)), received)
        phases.done("verify")
    if not received[0]["committed"]:
        coordinator.finish(version)
        phases.done("finish")
    return SyncReport(
        version,
        "checkpoint",
        len(engines),
        bytes=manifest.nbytes,
        buckets=0,
        seconds=phases.total,
        verified=config.verify,
        phases=phases.times,
        engine_times=phases.engine_times,
    )
