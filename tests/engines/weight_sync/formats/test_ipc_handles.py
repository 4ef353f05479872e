"""CUDA IPC handles on the CPU: which GPU's entry a receiver takes, the
rebuild arguments in both shapes senders use (OpenRLHF's `(rebuild_fn,
args)` and `args` alone), serialisation. Opening one needs a GPU
(tests/gpu/test_gpu_weight_sync.py, tests/gpu/test_gpu_openrlhf.py)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.formats import ipc_handles

# reduce_tensor's rebuild args for a CUDA tensor: (type, shape, stride, offset,
# storage type, dtype, device index, handle, ...); index 6 is the device.
ARGS = ("Tensor", (4,), (1,), 0, "UntypedStorage", torch.float32, 3, b"handle", 16)


def test_receiver_takes_its_gpus_handle_and_its_own_device_index():
    handles = {"GPU-aaa": ARGS, "GPU-bbb": ARGS[:6] + (5,) + ARGS[7:]}
    args = ipc_handles.select_handle(handles, "GPU-bbb", device_index=0)
    assert args[ipc_handles.DEVICE_ARG] == 0
    assert args[:6] == list(ARGS[:6]) and args[7:] == list(ARGS[7:])


def test_a_handle_for_another_gpu_is_a_clear_error():
    with pytest.raises(WeightTransferError, match="GPU-ccc.*'GPU-aaa'"):
        ipc_handles.select_handle({"GPU-aaa": ARGS}, "GPU-ccc", 0)
    with pytest.raises(WeightTransferError, match="malformed"):
        ipc_handles.select_handle({"GPU-aaa": ARGS[:3]}, "GPU-aaa", 0)


def test_handles_merge_across_ranks_and_survive_bytes():
    merged = ipc_handles.merge_handles([{"GPU-a": ARGS}, {"GPU-b": ARGS}])
    assert set(merged) == {"GPU-a", "GPU-b"}
    with pytest.raises(ValueError, match="GPU-a"):
        ipc_handles.merge_handles([{"GPU-a": ARGS}, {"GPU-a": ARGS}])
    assert ipc_handles.loads(ipc_handles.dumps(merged)) == merged


def test_sharing_a_cpu_tensor_is_refused():
    with pytest.raises(ValueError, match="CUDA tensor"):
        ipc_handles.share(torch.zeros(3))


def openrlhf_handles(weight_handle: tuple, gpu: str) -> dict:
    """The `ipc_handles` argument as OpenRLHF 0.11.2 builds it
    (openrlhf/trainer/ray/ppo_actor.py, `_handle_cuda_ipc`): `reduce_tensor`'s
    pair under the GPU's UUID, merged across ranks."""
    ipc_handle = weight_handle  # reduce_tensor(weight)
    ipc_handle = {gpu: ipc_handle}
    ipc_handle_list = [ipc_handle]  # all_gather_object of one rank
    ipc_handles = {}
    for d in ipc_handle_list:
        ipc_handles.update(d)
    return ipc_handles


def test_openrlhfs_rebuild_fn_and_args_pair_is_taken_as_its_args():
    sent = openrlhf_handles((rebuild_cuda_tensor, ARGS), "GPU-aaa")
    # Through the bytes the engine actor hands its workers, too.
    for handles in (sent, ipc_handles.loads(ipc_handles.dumps(sent))):
        args = ipc_handles.select_handle(handles, "GPU-aaa", device_index=1)
        assert args == list(ARGS[:6]) + [1] + list(ARGS[7:])


def test_args_alone_still_work():
    args = ipc_handles.select_handle({"GPU-aaa": ARGS}, "GPU-aaa", device_index=0)
    assert args == list(ARGS[:6]) + [0] + list(ARGS[7:])


def test_a_rebuild_function_other_than_torchs_cuda_one_is_refused():
    # A real reduce_tensor pair, of a CPU tensor: its function is not
    # rebuild_cuda_tensor, so it is refused, not called.
    cpu_pair = reduce_tensor(torch.zeros(3))
    with pytest.raises(WeightTransferError, match="not torch's rebuild_cuda_tensor"):
        ipc_handles.select_handle(openrlhf_handles(cpu_pair, "GPU-aaa"), "GPU-aaa", 0)
    called = []
    with pytest.raises(WeightTransferError, match="refused"):
        ipc_handles.rebuild_args((lambda *a: called.append(a), ARGS))
    assert not called
