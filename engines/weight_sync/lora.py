"""Transport: LoRA adapter-only sync. The trainer sends an adapter's tensors
(peft names, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)
with its rank, alpha and target modules; the engines serve the base model
plus that adapter, through vLLM's runtime LoRA support (`engines/vllm/adapters.py`)
or peft on the CPU backend (`engines/hf/adapters.py`).

Each adapter version is a weight version. An engine keeps the adapters of
the last `keep` versions (`max_staleness + 1` under `in_flight`), so a
request runs to its end on the adapter of the version it was admitted
under; older ones are removed, each once no request runs on it.

How the tensors travel (`via`): `cuda_ipc` (colocated: one packed buffer of
the trainer's, mapped by the engines once and read again at every sync),
`checkpoint` (a peft adapter directory), `inline` (the adapter in the call
itself, as safetensors bytes: an adapter is megabytes, and the broadcast's
group is not worth it). No file round-trip on `cuda_ipc` and `inline`: the
engines build the adapter from the tensors they received.

A trainer written to vLLM's native API may send an adapter's tensors too
(`vllm_native.update_weights` hands them to `load_adapter` / `worker_load`).

The adapter's shape and files: `adapter.py`. Trainer: `LoraSender`. Engine
actor: `receive_lora_adapter`, `release_lora_buffer`, `lora_adapters`.
Worker: the same names.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Iterator
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
from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats import ipc_handles as ipc
from engines.weight_sync.formats.adapter import (
    LoraSpec,
    LoraSync,
    PackedAdapter,
    received_tensors,
    save_adapter,
    tensor_module,
)
from engines.weight_sync.formats.buckets import ALIGN, Bucket, pack_bucket, plan_buckets
from engines.weight_sync.formats.checksum import nbytes_of
from engines.weight_sync.probe import ProbeResult
from engines.weight_sync.protocol import (
    Received,
    SenderOptions,
    SyncReport,
    Transport,
    WorkerAnswer,
)
from engines.weight_sync.session import WeightSync
from engines.weight_sync.worker import WorkerWeights

#: How the adapter's tensors reach the engines.
VIAS = ("cuda_ipc", "checkpoint", "inline")
#: The trainer's full-weight transport -> how its adapter travels instead.
VIA_OF_TRANSPORT = {"cuda_ipc": "cuda_ipc", "checkpoint": "checkpoint", "broadcast": "inline"}


# --- trainer side --------------------------------------------------------------------------
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
        # cuda_ipc: (manifest, bucket, buffer) of the packed buffer the
        # engines keep mapped, and its name.
        self._manifests = ManifestCache()
        self._packed: tuple[Any, Bucket, Any] | None = None
        self._mapping: str | None = None
        self._mapped = False

    def init(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("no engines to sync")
        self.close()
        self.engines = as_engine_list(engines)

    def summary(self) -> dict[str, Any]:
        return {"lora": self.lora.spec.plain(), "keep": self.lora.keep, "via": self.via}

    def close(self) -> None:
        if self.engines and self._mapped:
            from engines.client import call_engines

            call_engines(self.engines, "release_lora_buffer", timeout_s=self.config.timeout_s)
        self._packed = self._mapping = None
        self._mapped = False
        self.engines = []

    def _payload(self, weights: list[tuple[str, Any]], version: int) -> Any:
        if self.via == "inline":
            from safetensors.torch import save

            return save({n: t.contiguous().cpu() for n, t in weights})
        if self.via == "checkpoint":
            return str(
                save_adapter(
                    weights, self.lora.spec, Path(self.checkpoint_dir, f"lora-v{version:06d}")
                )
            )
        return self._pack(weights)

    def _pack(self, weights: list[tuple[str, Any]]) -> bytes:
        """One buffer of every tensor (a broadcast bucket's layout), kept
        across syncs: the engines map it once, so a later sync sends only
        its name and opens nothing."""
        import torch

        if not all(t.is_cuda for _, t in weights):
            raise ValueError("CUDA IPC sends an adapter on a GPU")
        manifest = self._manifests.of(weights)
        if self._packed is None or self._packed[0] is not manifest:
            room = manifest.nbytes + ALIGN * len(manifest.params)  # one bucket
            (bucket,) = plan_buckets(manifest, room).buckets
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=weights[0][1].device)
            self._packed = (manifest, bucket, buffer)
            self._mapping, self._mapped = uuid.uuid4().hex, False
        _, bucket, buffer = self._packed
        pack_bucket(bucket, dict(weights), out=buffer)
        torch.cuda.synchronize(buffer.device)  # the engines read it from another process
        if self._mapped:
            return ipc.dumps({"mapping": self._mapping, "handles": None, "bucket": None})
        layout = bucket.model_dump(mode="json")
        return ipc.dumps({"mapping": self._mapping, "handles": ipc.share(buffer), "bucket": layout})

    def sync(self, weights: Any, version: int, probe: Any = None) -> SyncReport:
        # `probe` is not run: an adapter version is served from its commit
        # on, after the point where the engines run the probe.
        if not self.engines:
            raise WeightSyncError("call init(engines) before sync")
        weights = trainer_weights(weights)
        self.lora.spec.check_tensors(weights)
        phases = Phases()
        payload = self._payload(weights, version)
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
        # Moments compare clocks: only colocated engines (CUDA IPC) share the trainer's.
        stamps = ("actor_in_at", "worker_in_at", "loaded_at", "actor_out_at") if wake else ()
        phases.engines_reported(received, "pause_s", "open_s", "load_s", "call_s", *stamps)
        phases.done("transfer")
        if not received[0].committed:
            coordinator.finish(version, wake=["kv_cache"] if wake else None)
            phases.done("finish")
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
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


# --- engine actor --------------------------------------------------------------------------
class AdapterVersions:
    """The engine actor's adapters: the versions loaded (oldest first) and
    how many requests run on each, so none is removed under a request."""

    def __init__(self) -> None:
        self.loaded: list[int] = []
        self.running: Counter[int | None] = Counter()

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[int | None]:
        """The adapter a request admitted at `version` runs on (None: the
        base model), held for as long as the request runs."""
        adapter = version if version in self.loaded else None
        self.running[adapter] += 1
        try:
            yield adapter
        finally:
            self.running[adapter] -= 1

    def to_remove(self, version: int, keep: int, served: int) -> list[int]:
        """Versions outside the last `keep` once `version` is loaded, and
        idle. The version `served` stays until this sync commits: if it
        fails, the engine serves it on."""
        window = {*sorted({*self.loaded, version})[-keep:], served}
        return [v for v in self.loaded if v not in window and not self.running[v]]


def adapter_versions(sync: WeightSync) -> AdapterVersions:
    return sync.held.setdefault("lora", AdapterVersions())


def checked_spec(sync: WeightSync, spec: dict) -> LoraSpec:
    """`spec` as this engine takes it: LoRA enabled, a rank within its max."""
    config = sync.host.config
    if not getattr(config, "enable_lora", False):
        raise WeightSyncError(f"engine {sync.name} was started without enable_lora=True")
    try:
        checked = LoraSpec.of(spec)
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightSyncError(f"engine {sync.name}: bad adapter {spec!r}: {exc}") from exc
    if checked.rank > config.max_lora_rank:
        raise WeightSyncError(
            f"engine {sync.name}: adapter rank {checked.rank} is above its "
            f"max_lora_rank={config.max_lora_rank}"
        )
    return checked


async def load_adapter(sync: WeightSync, keep: int, method: str, *args: Any) -> Received:
    """Run the worker receive `method(*args, version, remove)` of the open
    sync's adapter; `remove`: the versions older than the last `keep` that no
    request runs on."""
    session = sync.session()
    versions = adapter_versions(sync)
    remove = versions.to_remove(session.version, int(keep), sync.host.weight_version)
    received = await sync.receive(method, *args, session.version, remove, session=session)
    versions.loaded = sorted((set(versions.loaded) - set(remove)) | {session.version})
    return received


async def receive_lora_adapter(
    sync: WeightSync, version: int, spec: dict, via: str, payload: Any, keep: int
) -> Received:
    """Load the adapter of `version` (the sync's), `via` one of `VIAS`."""
    checked = checked_spec(sync, spec)
    if via not in VIAS:
        raise WeightSyncError(f"via must be one of {VIAS}, got {via!r}")
    sync.session(version)
    return await load_adapter(sync, keep, "receive_lora_adapter", checked.plain(), via, payload)


# vLLM's native API (`vllm_native.update_weights`) carrying an adapter.
def is_adapter(names: list[str]) -> bool:
    return bool(names) and all(".lora_A." in n or ".lora_B." in n for n in names)


def native_spec(sync: WeightSync, names: list[str], shapes: list[list[int]]) -> LoraSpec:
    """vLLM's API carries named tensors only: the rank is lora_A's rows, the
    targets are the names' modules, and the scaling is 1 (alpha = rank: the
    trainer sends lora_B scaled by its alpha / rank)."""
    ranks = {int(s[0]) for n, s in zip(names, shapes, strict=True) if ".lora_A." in n}
    if len(ranks) != 1:
        raise WeightSyncError(f"engine {sync.name}: an adapter has one rank, got {sorted(ranks)}")
    rank = ranks.pop()
    targets = sorted({tensor_module(n) for n in names})
    return checked_spec(sync, {"rank": rank, "alpha": rank, "target_modules": targets})


def native_keep(sync: WeightSync) -> int:
    """Over vLLM's API no trainer says how many versions to keep: as many as
    the engine's `max_loras` (an engine argument; default 1)."""
    return int(sync.host.config.engine_kwargs.get("max_loras", 1))


async def lora_adapters(sync: WeightSync) -> list[str]:
    """The adapters rank 0's worker holds, by name (`adapter_name`)."""
    return (await sync.rpc("lora_adapters"))[0]


async def release_lora_buffer(sync: WeightSync) -> None:
    """Drop the trainer's adapter buffer the workers keep mapped."""
    await sync.rpc("release_lora_buffer")


# --- worker --------------------------------------------------------------------------------
def adapter_store(worker: WorkerWeights) -> Any:
    """The worker's adapters: vLLM's LoRA manager or peft, made on first use."""
    if worker.adapters is None:
        if worker.is_vllm_model():
            from engines.vllm.adapters import VllmAdapters as store
        else:
            from engines.hf.adapters import PeftAdapters as store
        worker.adapters = store(worker.host)
    return worker.adapters


def worker_receive_lora(
    worker: WorkerWeights, spec: dict, via: str, payload: Any, version: int, remove: list[int]
) -> dict:
    """Receive the adapter of `version` `via` one of `VIAS`, then `worker_load`."""
    started = time.monotonic()
    tensors = received_tensors(worker, via, payload)
    return worker_load(worker, spec, tensors, version, remove, time.monotonic() - started)


def worker_load(
    worker: WorkerWeights,
    spec: dict,
    tensors: dict[str, Any] | PackedAdapter,
    version: int,
    remove: list[int],
    open_s: float = 0.0,
) -> dict:
    """Build the adapter of `version` from `tensors` (owned by this worker,
    or the trainer's mapped buffer, which the store copies) and register it;
    remove the versions in `remove`. A bad adapter (a target module the model
    has not, too many adapters) changes nothing and is answered as problems.
    `times`: seconds, and `*_at` moments (monotonic, one clock for every
    process of the host) the trainer turns into offsets into its sync."""
    opened = time.monotonic()
    store = adapter_store(worker)
    checked = LoraSpec.of(spec)
    packed = isinstance(tensors, PackedAdapter)
    names = tensors.names() if packed else list(tensors)
    problems = store.problems(checked, names, version, remove)
    if problems:
        return WorkerAnswer(problems=problems, holds_sync_state=False).plain()
    store.load(version, checked, tensors, remove)
    if worker.device.type == "cuda":
        import torch

        torch.cuda.synchronize(worker.device)  # the copy out of the trainer's buffer is done
    nbytes = tensors.nbytes if packed else sum(nbytes_of(t) for t in tensors.values())
    done = time.monotonic()
    times = {"open_s": open_s, "load_s": done - opened}
    times.update(worker_in_at=opened - open_s, loaded_at=done)
    return WorkerAnswer(bytes=nbytes, holds_sync_state=False, times=times).plain()


def worker_release_buffer(worker: WorkerWeights) -> None:
    worker.held.pop("lora_ipc", None)


def worker_lora_adapters(worker: WorkerWeights) -> list[str]:
    return adapter_store(worker).loaded() if worker.adapters is not None else []


TRANSPORT = Transport(
    "lora",
    engine_methods={
        "receive_lora_adapter": receive_lora_adapter,
        "release_lora_buffer": release_lora_buffer,
        "lora_adapters": lora_adapters,
    },
    worker_methods={
        "receive_lora_adapter": worker_receive_lora,
        "release_lora_buffer": worker_release_buffer,
        "lora_adapters": worker_lora_adapters,
    },
    one_call=("receive_lora_adapter",),
)
