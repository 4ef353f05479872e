"""CUDA IPC: hand an engine worker on the same GPU a view of the trainer's
memory (one GPU cannot hold two NCCL ranks, so colocated engines sync this way).

Sender: `share(tensor)` -> `{gpu_uuid: rebuild_args}` (torch's
`reduce_tensor`); the tensor must stay alive until every receiver has copied
it. Receiver: `open_shared(handles, device_index)` picks the entry of its own
GPU by UUID (the same physical GPU has different indices in processes with
different CUDA_VISIBLE_DEVICES) and rebuilds the tensor on its own device
index (argument 6 of the rebuild args, as vLLM's `IPCWeightTransferEngine`
and OpenRLHF do).

Handles cross vLLM's msgpack hop only as bytes (`dumps` / `loads`).

Completion: a worker that keeps the trainer's tensors mapped records an
interprocess CUDA event after queueing its copies and answers at once; the
trainer waits on that event (`CopyEvents`), so the answer's way back
(through vLLM's engine core and Ray) overlaps the copies instead of following
them (a 7B sync on an H200: 17.7 -> 12.0 ms, together with the copy plan's
one check per graph; docs/benchmarks.md).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from engines.weight_sync.errors import WeightTransferError

#: Index of the device index in the args of `rebuild_cuda_tensor`.
DEVICE_ARG = 6


def gpu_uuid(device_index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device_index).uuid)


def share(tensor: Any) -> dict[str, tuple]:
    """IPC handle of a CUDA tensor, keyed by its GPU's UUID."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"CUDA IPC needs a CUDA tensor, got one on {tensor.device}")
    _rebuild, args = reduce_tensor(tensor.detach())
    return {gpu_uuid(tensor.device.index): tuple(args)}


def merge_handles(per_rank: list[dict[str, tuple]]) -> dict[str, tuple]:
    """One dict from the handles of several trainer ranks (one GPU each), so
    every engine worker finds its own GPU; two ranks on one GPU are an error."""
    merged: dict[str, tuple] = {}
    for handles in per_rank:
        for uuid, args in handles.items():
            if uuid in merged:
                raise ValueError(f"two trainer ranks shared memory of GPU {uuid}")
            merged[uuid] = args
    return merged


def select_handle(handles: dict[str, tuple], uuid: str, device_index: int) -> list:
    """The rebuild args for this receiver: its GPU's entry, with the device
    index replaced by the receiver's own."""
    if uuid not in handles:
        raise WeightTransferError(
            f"no CUDA IPC handle for this worker's GPU {uuid} (handles for {sorted(handles)}); "
            "the trainer must run on the same GPU as the engine (colocated)"
        )
    args = list(handles[uuid])
    if len(args) <= DEVICE_ARG:
        raise WeightTransferError(f"malformed CUDA IPC handle: {len(args)} rebuild args")
    args[DEVICE_ARG] = device_index
    return args


def open_shared(handles: dict[str, tuple], device_index: int) -> Any:
    """The trainer's tensor, mapped into this process (no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*select_handle(handles, gpu_uuid(device_index), device_index))


def dumps(handles: dict[str, tuple]) -> bytes:
    """Handles as bytes: vLLM's msgpack RPC refuses torch types otherwise."""
    return pickle.dumps(handles)


def loads(blob: bytes) -> dict[str, tuple]:
    # pickle from our own trainer over the cluster's RPC, the same trust as
    # Ray's own object transport.
    handles = pickle.loads(blob)
    if not isinstance(handles, dict):
        raise WeightTransferError(f"CUDA IPC handles must be a dict, got {type(handles).__name__}")
    return handles


def copy_event() -> Any:
    """A CUDA event other processes can open by its handle (`CopyEvents`)."""
    import torch

    return torch.cuda.Event(interprocess=True)


class CopyEvents:
    """The trainer's side: the workers' copy events, opened once each, waited on."""

    def __init__(self) -> None:
        self._opened: dict[bytes, Any] = {}

    def wait(self, handles: list[bytes], device: Any, timeout_s: float) -> None:
        """Return once every event has completed; WeightTransferError after `timeout_s`."""
        import torch

        deadline = time.monotonic() + timeout_s
        for handle in handles:
            event = self._opened.get(handle)
            if event is None:
                event = _cuda(torch.cuda.Event.from_ipc_handle, device, handle)
                self._opened[handle] = event
            # Polled: Event.synchronize() has no deadline, and a worker that
            # dies mid-copy must not hang the trainer. The poll lasts at most
            # the copies' few milliseconds.
            while not _cuda(event.query):
                if time.monotonic() > deadline:
                    raise WeightTransferError(
                        f"the engines' copies of the shared weights did not finish "
                        f"within {timeout_s:g}s"
                    )
                time.sleep(0)

    def clear(self) -> None:
        self._opened.clear()


def _cuda(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except RuntimeError as exc:  # CUDA's own: a bad handle, a lost context
        raise WeightTransferError(f"waiting for an engine's copies failed: {exc}") from exc
