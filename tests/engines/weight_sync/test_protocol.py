"""The transports' registry and choices (factory.py, no processes): which
transport a trainer uses where, its sender from the registry; and the
protocol's one report."""

from __future__ import annotations

import pytest

from engines.weight_sync import BroadcastSender, CheckpointSender, CudaIpcSender, SyncConfig
from engines.weight_sync.factory import new_sender, trainer_transports, transport_for
from engines.weight_sync.protocol import SenderOptions, SyncReport


def options(**kwargs) -> SenderOptions:
    return SenderOptions(SyncConfig(), weights_device=lambda: "cpu", **kwargs)


def test_the_transport_follows_placement():
    assert transport_for(colocated=True, device="cuda") == "cuda_ipc"
    assert transport_for(colocated=False, device="cuda") == "broadcast"
    # One CPU cannot share tensors by CUDA IPC: colocated CPU engines broadcast.
    assert transport_for(colocated=True, device="cpu") == "broadcast"
    assert transport_for(colocated=True, device="cuda", checkpoint_dir="/ckpt") == "checkpoint"


def test_each_trainer_transport_has_its_sender_in_the_registry():
    # OpenRLHF's and vLLM's trainers bring their own trainer side.
    assert {"broadcast", "cuda_ipc", "checkpoint"} <= set(trainer_transports())
    assert not {"openrlhf", "vllm_native"} & set(trainer_transports())
    assert isinstance(new_sender("broadcast", options()), BroadcastSender)
    assert isinstance(new_sender("cuda_ipc", options()), CudaIpcSender)
    sender = new_sender("checkpoint", options(checkpoint_dir="/ckpt"))
    assert isinstance(sender, CheckpointSender) and sender.directory == "/ckpt"


def test_a_sender_is_refused_without_what_it_needs():
    with pytest.raises(ValueError, match="transport must be one of .* got 'openrlhf'"):
        new_sender("openrlhf", options())  # OpenRLHF's trainer is its own
    with pytest.raises(ValueError, match="'checkpoint' needs checkpoint_dir"):
        new_sender("checkpoint", options())


def test_only_the_broadcast_sender_asks_for_the_weights_device():
    asked = []

    def device():
        asked.append(True)
        return "cpu"

    new_sender("cuda_ipc", SenderOptions(SyncConfig(), weights_device=device))
    assert not asked
    assert new_sender("broadcast", SenderOptions(SyncConfig(), weights_device=device)).device
    assert asked


def test_a_report_gives_its_rate_and_a_skipped_sync_moved_nothing():
    report = SyncReport(3, "broadcast", 2, bytes=4_000_000, seconds=0.25)
    assert report.gb_per_s == pytest.approx(0.016)
    skipped = SyncReport(3, "cuda_ipc", 1, skipped=True)
    assert (skipped.bytes, skipped.seconds, skipped.gb_per_s) == (0, 0.0, 0.0)
