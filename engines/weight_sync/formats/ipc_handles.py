"""CUDA IPC handles: a CUDA tensor shared with another process on the same
GPU, as torch's `reduce_tensor` describes it. The CUDA IPC transport
(`cuda_ipc.py`), OpenRLHF's colocated calls (`openrlhf.py`) and vLLM's IPC
weight transfer (`vllm_native.py`) all open tensors through here.

Sender: `share(tensor)` -> `{gpu_uuid: rebuild_args}`; the tensor must stay
alive until every receiver has copied it. Receiver: `open_shared(handles,
device_index)` picks the entry of its own GPU by UUID (the same physical GPU
has different indices in processes with different CUDA_VISIBLE_DEVICES) and
rebuilds the tensor on its own device index (argument 6 of the rebuild args,
as vLLM's `IPCWeightTransferEngine` and OpenRLHF do). An entry is the rebuild
args, or `(rebuild_fn, args)` as `reduce_tensor` returns them (OpenRLHF's
`_handle_cuda_ipc` sends those). Handles cross vLLM's msgpack hop only as
bytes (`dumps` / `loads`).
"""

from __future__ import annotations

import pickle
from typing import Any

from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.formats.manifest import ParamSpec, torch_dtype

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
        for gpu, args in handles.items():
            if gpu in merged:
                raise ValueError(f"two trainer ranks shared memory of GPU {gpu}")
            merged[gpu] = args
    return merged


def rebuild_args(handle: Any) -> list:
    """The rebuild args of one handle, sent as `reduce_tensor` gives it,
    `(rebuild_fn, args)` (OpenRLHF's `_handle_cuda_ipc`), or as `args` alone.
    The function is only checked, never called: torch's `rebuild_cuda_tensor`
    is the one we run, since calling a callable that came over the wire
    would run whatever code the sender named."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(handle) == 2 and callable(handle[0]):
        rebuild, args = handle
        if rebuild is not rebuild_cuda_tensor:
            raise WeightTransferError(
                f"CUDA IPC handle rebuilds with {getattr(rebuild, '__qualname__', rebuild)!r}, "
                "not torch's rebuild_cuda_tensor: refused (a CUDA tensor's reduce_tensor gives "
                "rebuild_cuda_tensor)"
            )
        return list(args)
    return list(handle)


def select_handle(handles: dict[str, tuple], uuid: str, device_index: int) -> list:
    """The rebuild args for this receiver: its GPU's entry (`rebuild_args`),
    with the device index replaced by the receiver's own."""
    if uuid not in handles:
        raise WeightTransferError(
            f"no CUDA IPC handle for this worker's GPU {uuid} (handles for {sorted(handles)}); "
            "the trainer must run on the same GPU as the engine (colocated)"
        )
    args = rebuild_args(handles[uuid])
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


def open_announced(worker: Any, spec: ParamSpec, handles: dict) -> Any:
    """The trainer's tensor behind `handles`, which must be what `spec` announced."""
    tensor = open_shared(handles, worker.device.index)
    if tuple(tensor.shape) != spec.shape or tensor.dtype != torch_dtype(spec.dtype):
        raise WeightTransferError(
            f"{spec.name!r}: the shared tensor is {tensor.dtype} {list(tensor.shape)}, "
            f"announced {spec.dtype} {list(spec.shape)}"
        )
    return tensor
