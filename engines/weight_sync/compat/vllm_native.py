"""Transport: vLLM's native weight-transfer API (vLLM 0.26,
`vllm/distributed/weight_transfer/`), so a trainer written to vLLM's docs
syncs our engines unchanged. Its client (`RayVLLMWeightSyncClient`, or any
object with the four methods of `VLLMWeightSyncClient`) calls, on each engine
actor:

- `init_weight_transfer_engine(request)`: `request.init_info` (or
  `request["init_info"]`) is
  `{master_address, master_port, rank_offset, world_size}` for the NCCL
  backend: each worker joins the trainer's group (`group.py`: vLLM's
  `StatelessProcessGroup` + `PyNcclCommunicator` on GPUs, the same
  rendezvous as vLLM's `trainer_init`; gloo on CPU engines). An empty
  `init_info` is the IPC backend: nothing to join.
- `start_weight_update()`: opens our sync to version + 1 (pause, watchdog).
- `update_weights(request)`: `request.update_info` is vLLM's
  `NCCLWeightTransferUpdateInfo` (names, dtype_names, shapes, packed,
  packed_buffer_size_bytes) or `IPCWeightTransferUpdateInfo` (+ ipc_handles,
  tensor_sizes when packed). The names, dtypes and shapes are checked against
  the engine's manifest before any byte moves; the workers receive with our
  deadlines (`WeightGroup`) and load through the copy plan, recording the
  checksums of what arrived (`weight_checksums`).
- `finish_weight_update()`: commits the version (prefix cache reset, resume).

The trainer side is vLLM's own (`NCCLWeightTransferEngine.trainer_send_weights`,
`TrainerWeightTransferEngine`); nothing of it is repeated here.
"""

from __future__ import annotations

from typing import Any

from engines.weight_sync.config import DEFAULT_GROUP_NAME
from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats import ipc_handles as ipc
from engines.weight_sync.formats.manifest import Manifest, ParamSpec, torch_dtype
from engines.weight_sync.lora import engine as lora_engine
from engines.weight_sync.lora import worker as lora_worker
from engines.weight_sync.protocol import Transport, WorkerAnswer
from engines.weight_sync.session import WeightSync
from engines.weight_sync.worker import WorkerWeights

#: vLLM's defaults (`packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES`).
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
NCCL_INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size"}


def _info(request: Any, field: str) -> dict:
    """vLLM's request dataclass, or a dict holding `field`, as vLLM's `LLM` takes them."""
    info = request.get(field) if isinstance(request, dict) else getattr(request, field, None)
    if not isinstance(info, dict):
        raise WeightSyncError(
            f"expected vLLM's request with a {field} dict, got {type(request).__name__}"
        )
    return info


# --- engine actor --------------------------------------------------------------------------
async def init_weight_transfer_engine(sync: WeightSync, request: Any) -> None:
    """vLLM's `init_weight_transfer_engine(WeightTransferInitRequest)`."""
    info = _info(request, "init_info")
    if not info:  # IPC: the handles come with each update
        return
    if set(info) != NCCL_INIT_KEYS:
        raise WeightSyncError(
            f"init_info takes {sorted(NCCL_INIT_KEYS)} (vLLM's NCCL backend), got {sorted(info)}"
        )
    rank_offset = info["rank_offset"]
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 1:
        raise WeightSyncError(f"rank_offset must be an integer >= 1, got {rank_offset!r}")
    await sync.rpc("native_init_weight_transfer", info, sync.rpc_timeout())
    sync.in_group = True


async def start_weight_update(sync: WeightSync) -> None:
    """vLLM's `start_weight_update()`: open a sync to the next version."""
    await sync.begin_weight_sync(sync.host.weight_version + 1)


async def update_weights(sync: WeightSync, request: Any) -> None:
    """vLLM's `update_weights(WeightTransferUpdateRequest)`: one chunk of the sync."""
    info = _info(request, "update_info")
    session = sync.session()
    adapter = None
    try:
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightSyncError(
                f"update_info has {len(names)} names, {len(dtypes)} dtype_names and "
                f"{len(shapes)} shapes"
            )
        manifest = Manifest(
            params=tuple(
                ParamSpec(name=n, dtype=d, shape=tuple(s))
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            )
        )
        if lora_engine.is_adapter(names):  # a LoRA adapter's tensors (lora/)
            adapter = lora_engine.native_spec(sync, names, shapes)
            if sync.held.get("lora_native") is session:
                raise WeightSyncError("an adapter comes in one update_weights call per sync")
            sync.held["lora_native"] = session
        else:
            # Before any byte moves: a bad name or shape changes nothing.
            await sync.check_weight_manifest(manifest.plain, allow_partial=True)
    except Exception as exc:
        await sync.abort_weight_sync(f"update_weights refused: {exc}")
        if isinstance(exc, WeightSyncError):
            raise
        raise WeightSyncError(f"engine {sync.name}: invalid update_info: {exc}") from exc
    plain = dict(info)
    if "ipc_handles" in plain:  # bytes across vLLM's msgpack hop
        handles = plain["ipc_handles"]
        plain["ipc_handles"] = (
            ipc.dumps(handles) if isinstance(handles, dict) else [ipc.dumps(h) for h in handles]
        )
    # One call receives every collective: the deadline grows with their number.
    if "ipc_handles" in info:
        collectives = 1
    elif info.get("packed"):
        size = int(info.get("packed_buffer_size_bytes") or DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        collectives = len(_packed_chunks(list(manifest.params), size))
    else:
        collectives = len(names)
    if adapter is not None:
        keep = lora_engine.native_keep(sync)
        await lora_engine.load_adapter(sync, keep, "native_update_weights", plain, adapter.plain())
        return
    await sync.receive(
        "native_update_weights",
        plain,
        session=session,
        timeout_s=sync.rpc_timeout() * max(1, collectives),
    )


async def finish_weight_update(sync: WeightSync) -> None:
    """vLLM's `finish_weight_update()`: serve the new version."""
    await sync.finish_weight_sync(sync.session().version)


# --- worker --------------------------------------------------------------------------------
def worker_init(worker: WorkerWeights, info: dict, timeout_s: float) -> int:
    """Join the trainer's group as vLLM's workers do (rank_offset + rank):
    NCCL on a GPU, gloo on a CPU engine."""
    return worker.init_process_group(
        info["master_address"],
        int(info["master_port"]),
        int(info["rank_offset"]),
        int(info["world_size"]),
        DEFAULT_GROUP_NAME,
        backend="nccl" if worker.device.type == "cuda" else "gloo",
        timeout_s=timeout_s,
    )


def worker_update_weights(
    worker: WorkerWeights,
    info: dict,
    adapter: dict | None = None,
    version: int | None = None,
    remove: list[int] | None = None,
) -> dict:
    """Receive the tensors `info` announces and load them; with `adapter`
    (a LoRA adapter's spec), build the adapter of `version` from them instead
    (`lora.worker.worker_load`)."""
    received: dict[str, Any] | None = None if adapter is None else {}

    def load(chunk: list[ParamSpec], tensors: list[Any]) -> None:
        if received is None:
            _load_chunk(worker, chunk, tensors)
        else:  # owned copies: IPC tensors are the trainer's memory
            received.update((s.name, t.clone()) for s, t in zip(chunk, tensors, strict=True))

    specs = [
        ParamSpec(name=n, dtype=d, shape=tuple(s))
        for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)
    ]
    if "ipc_handles" in info:
        weights = _open_ipc(worker, specs, info)
    elif info.get("packed"):
        weights = None
        size = int(info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES))
        for chunk in _packed_chunks(specs, size):
            load(chunk, _receive_packed(worker, chunk))
    else:
        weights = None
        for spec in specs:
            weight, _ = worker.receive_one(spec)  # names were checked by the engine
            load([spec], [weight])
    if weights is not None:
        load(specs, weights)
        import torch

        # The trainer reuses its buffers once we return.
        torch.cuda.synchronize(worker.device)
    if received is not None:
        return lora_worker.worker_load(worker, adapter, received, version, remove)
    return WorkerAnswer(bytes=sum(s.nbytes for s in specs)).plain()


def _load_chunk(worker: WorkerWeights, specs: list[ParamSpec], tensors: list[Any]) -> None:
    weights = [(s.name, t) for s, t in zip(specs, tensors, strict=True)]
    worker.record_wire(weights)
    worker.load(weights)


def _packed_chunks(specs: list[ParamSpec], buffer_bytes: int) -> list[list[ParamSpec]]:
    """vLLM's packing (`packed_nccl_broadcast_producer`): tensors are added to
    a buffer until it holds more than `buffer_bytes`."""
    chunks: list[list[ParamSpec]] = [[]]
    size = 0
    for spec in specs:
        chunks[-1].append(spec)
        size += spec.nbytes
        if size > buffer_bytes:
            chunks.append([])
            size = 0
    return [c for c in chunks if c]


def _receive_packed(worker: WorkerWeights, chunk: list[ParamSpec]) -> list[Any]:
    import torch

    flat = torch.empty(sum(s.nbytes for s in chunk), dtype=torch.uint8, device=worker.device)
    worker.live_group().broadcast(flat, src=0)
    return [
        part.view(torch_dtype(s.dtype)).view(*s.shape)
        for s, part in zip(chunk, flat.split([s.nbytes for s in chunk]), strict=True)
    ]


def _open_ipc(worker: WorkerWeights, specs: list[ParamSpec], info: dict) -> list[Any]:
    if not info.get("packed"):
        handles = [ipc.loads(h) for h in info["ipc_handles"]]
        return [ipc.open_announced(worker, s, h) for s, h in zip(specs, handles, strict=True)]
    # One buffer for the chunk, which the trainer reuses for the next chunk:
    # the views are cloned, as vLLM's `packed_ipc_consumer` does.
    flat = ipc.open_shared(ipc.loads(info["ipc_handles"]), worker.device.index)
    sizes = [int(n) for n in info.get("tensor_sizes") or ()]
    if sizes != [s.nbytes for s in specs] or flat.numel() < sum(sizes):
        raise WeightSyncError(
            f"tensor_sizes {sizes[:4]}... do not match the announced shapes and dtypes"
        )
    return [
        part.view(torch_dtype(s.dtype)).view(*s.shape).clone()
        for s, part in zip(specs, flat[: sum(sizes)].split(sizes), strict=True)
    ]


TRANSPORT = Transport(
    "vllm_native",
    engine_methods={
        "init_weight_transfer_engine": init_weight_transfer_engine,
        "start_weight_update": start_weight_update,
        "update_weights": update_weights,
        "finish_weight_update": finish_weight_update,
    },
    worker_methods={
        "native_init_weight_transfer": worker_init,
        "native_update_weights": worker_update_weights,
    },
)
