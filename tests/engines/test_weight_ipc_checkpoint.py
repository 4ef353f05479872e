"""The CPU-testable parts of CUDA IPC (handle choice, rebuild arguments,
serialisation, waiting for the engines' copies) and the safetensors
checkpoint layout."""

from __future__ import annotations

import json

import pytest
import torch

from engines.weight_sync import checkpoint, cuda_ipc
from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.manifest import Manifest

# reduce_tensor's rebuild args for a CUDA tensor: (type, shape, stride, offset,
# storage type, dtype, device index, handle, ...); index 6 is the device.
ARGS = ("Tensor", (4,), (1,), 0, "UntypedStorage", torch.float32, 3, b"handle", 16)


def test_receiver_takes_its_gpus_handle_and_its_own_device_index():
    handles = {"GPU-aaa": ARGS, "GPU-bbb": ARGS[:6] + (5,) + ARGS[7:]}
    args = cuda_ipc.select_handle(handles, "GPU-bbb", device_index=0)
    assert args[cuda_ipc.DEVICE_ARG] == 0
    assert args[:6] == list(ARGS[:6]) and args[7:] == list(ARGS[7:])


def test_a_handle_for_another_gpu_is_a_clear_error():
    with pytest.raises(WeightTransferError, match="GPU-ccc.*'GPU-aaa'"):
        cuda_ipc.select_handle({"GPU-aaa": ARGS}, "GPU-ccc", 0)
    with pytest.raises(WeightTransferError, match="malformed"):
        cuda_ipc.select_handle({"GPU-aaa": ARGS[:3]}, "GPU-aaa", 0)


def test_handles_merge_across_ranks_and_survive_bytes():
    merged = cuda_ipc.merge_handles([{"GPU-a": ARGS}, {"GPU-b": ARGS}])
    assert set(merged) == {"GPU-a", "GPU-b"}
    with pytest.raises(ValueError, match="GPU-a"):
        cuda_ipc.merge_handles([{"GPU-a": ARGS}, {"GPU-a": ARGS}])
    assert cuda_ipc.loads(cuda_ipc.dumps(merged)) == merged


def test_sharing_a_cpu_tensor_is_refused():
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ipc.share(torch.zeros(3))


class FakeCopyEvent:
    """An opened copy event: done after `pending` queries, or CUDA failing."""

    def __init__(self, pending: int = 0, fails: bool = False):
        self.pending, self.fails = pending, fails

    def query(self) -> bool:
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.pending -= 1
        return self.pending < 0


def copy_events(**opened: FakeCopyEvent) -> cuda_ipc.CopyEvents:
    events = cuda_ipc.CopyEvents()
    # Stands in for events opened by handle (that needs CUDA).
    events._opened.update({name.encode(): event for name, event in opened.items()})
    return events


def test_the_trainer_waits_for_every_engines_copies():
    slow, fast = FakeCopyEvent(pending=3), FakeCopyEvent()
    copy_events(slow=slow, fast=fast).wait([b"slow", b"fast"], None, timeout_s=5)
    assert slow.pending < 0 and fast.pending < 0


def test_waiting_for_copies_has_a_deadline_and_a_typed_error():
    events = copy_events(stuck=FakeCopyEvent(pending=10**9), lost=FakeCopyEvent(fails=True))
    with pytest.raises(WeightTransferError, match="did not finish within 0.05s"):
        events.wait([b"stuck"], None, timeout_s=0.05)
    with pytest.raises(WeightTransferError, match="copies failed: CUDA error"):
        events.wait([b"lost"], None, timeout_s=5)


def weights():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed.weight", torch.randn(16, 8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(16, 8, generator=g)),
    ]


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 600])
def test_checkpoint_round_trip(tmp_path, max_shard_bytes):
    path = checkpoint.save(weights(), tmp_path / "ckpt", version=7, max_shard_bytes=max_shard_bytes)
    sharded = max_shard_bytes < 1000
    assert (path / checkpoint.INDEX).exists() == sharded
    if sharded:
        index = json.loads((path / checkpoint.INDEX).read_text())
        assert set(index["weight_map"]) == {n for n, _ in weights()}
        assert len(checkpoint.shard_files(path)) == 2  # 512+16 bytes, then 512
    # safetensors orders tensors its own way; the layout is what must agree.
    assert checkpoint.read_manifest(path).by_name() == Manifest.of(weights()).by_name()
    assert checkpoint.read_version(path) == 7
    loaded = dict(checkpoint.iter_tensors(path))
    for name, tensor in weights():
        assert torch.equal(loaded[name], tensor)


def test_plain_hf_checkpoint_has_no_version(tiny_model):
    assert checkpoint.read_version(tiny_model) is None
    names = checkpoint.read_manifest(tiny_model).names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


def test_a_directory_without_weights_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        checkpoint.shard_files(tmp_path)
