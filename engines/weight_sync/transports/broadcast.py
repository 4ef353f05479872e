"""Transport: bucketed collective broadcast (gloo on CPU, NCCL on GPU).

The trainer is rank 0 of a weight group (`group.py`) with every engine
worker. Parameters are packed into flat buckets of `SyncConfig.bucket_bytes`
(`buckets.py`), one broadcast per bucket and one control call per engine per
sync. On GPUs the broadcasts run on a stream of their own and two buffers
take turns on both sides: bucket k+1 is packed (trainer) and received
(engine) while bucket k is on the wire or being loaded.

Trainer: `BroadcastSender` (here). Engine actor: `receive_weight_buckets`.
Worker: `receive_weight_buckets` (the same name, through `collective_rpc`);
both in `broadcast_receive.py`.
"""

from __future__ import annotations

import logging
from typing import Any

from engines.client import call_engines, raise_first_error
from engines.weight_sync.config import DEFAULT_GROUP_NAME, GroupInfo, SyncConfig, new_secret
from engines.weight_sync.coordinator import (
    Coordinator,
    ManifestCache,
    Phases,
    Weights,
    as_engine_list,
    trainer_weights,
)
from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats.buckets import (
    BucketPlan,
    bucket_key,
    iter_buckets,
    pack_bucket,
    plan_buckets,
)
from engines.weight_sync.formats.checksum import device_sums, finish_checksums
from engines.weight_sync.formats.manifest import Manifest
from engines.weight_sync.group import WeightGroup, listen, rendezvous_address
from engines.weight_sync.probe import ProbeReference
from engines.weight_sync.protocol import (
    Begun,
    SenderOptions,
    SyncReport,
    Transport,
)
from engines.weight_sync.transports.broadcast_receive import (
    receive_weight_buckets,
    worker_receive_buckets,
)

logger = logging.getLogger(__name__)


# --- trainer side --------------------------------------------------------------------------
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

    def init(self, engines: list[Any]) -> GroupInfo:
        """Build the group with `engines` (replacing any earlier group)."""
        import ray

        if not engines:
            raise ValueError("no engines to sync")
        self.close()
        self.engines = as_engine_list(engines)
        timeout = self.config.timeout_s
        nodes = raise_first_error(
            call_engines(self.engines, "weight_worker_nodes", timeout_s=timeout)
        )
        sizes = [len(n) for n in nodes]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        address = self.master_address or rendezvous_address(nodes)
        # Bound before the engines hear of the port: it cannot be taken
        # meanwhile, and it listens on `address` only.
        listener = listen(address)
        info = GroupInfo(
            address,
            listener.getsockname()[1],
            1 + sum(sizes),
            self.group_name,
            self.backend,
            timeout,
            new_secret(),
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
                secret=info.secret,
            )
            for engine, offset in zip(self.engines, offsets, strict=True)
        ]
        try:
            group = WeightGroup(info, rank=0, device=self.device, listener=listener)
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

    def summary(self) -> dict[str, Any]:
        return {"world_size": self.info.world_size, "backend": self.info.backend}

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
        """The buckets of `manifest` and their plain form (made again on a new manifest or size)."""
        key = (manifest, self.config.bucket_bytes)
        if self._plan is None or self._plan[0] != key:
            plan = plan_buckets(manifest, self.config.bucket_bytes)
            self._plan = (key, plan, plan.model_dump(mode="json"))
        return self._plan[1], self._plan[2]

    def _group_intact(self, begun: list[Begun]) -> bool:
        """Our group is up with every engine worker in it (their answers to begin)."""
        if self.group is None or not self.group.alive:
            logger.info("weight group is down: rebuilding it")
            return False
        if any(i != self.group.group_id for answer in begun for i in answer.group_ids):
            logger.warning("engines left weight group %s: rebuilding it", self.group.group_id)
            return False
        return True

    def sync(
        self, weights: Weights, version: int, probe: ProbeReference | None = None
    ) -> SyncReport:
        """Push `weights` as `version`: `start`, send every bucket, `finish`."""
        transfer = self.start(weights, version, probe)
        transfer.send()
        return transfer.finish()

    def start(
        self, weights: Weights, version: int, probe: ProbeReference | None = None
    ) -> BroadcastTransfer:
        """Check the manifest on every engine, open the sync (engines pause),
        and have them wait for the buckets. Rebuilds the group if a failed
        sync tore it down."""
        if not self.engines:
            raise WeightSyncError("call init(engines) before sync")
        weights = trainer_weights(weights)
        manifest = self._manifests.of(weights)
        coordinator = Coordinator(self.engines, self.config, probe)
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

        self.sender, self.coordinator, self.version = sender, coordinator, version
        self.phases, self.manifest = phases, manifest
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
        return self.phases.report(
            self.version,
            self.sender.transport,
            len(self.sender.engines),
            nbytes=self.manifest.nbytes,
            verified=config.verify,
            buckets=len(self.plan.buckets),
            probe=self.coordinator.probe_result(),
        )


def new_sender(options: SenderOptions) -> BroadcastSender:
    return BroadcastSender(options.config, backend=options.backend, device=options.weights_device())


TRANSPORT = Transport(
    "broadcast",
    engine_methods={"receive_weight_buckets": receive_weight_buckets},
    worker_methods={"receive_weight_buckets": worker_receive_buckets},
    new_sender=new_sender,
)
