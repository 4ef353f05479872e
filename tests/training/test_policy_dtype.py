"""The policy trains in float32 but sends weights in the engines' dtype."""

from __future__ import annotations

import torch

from engines.tiny_model import build_tiny_model
from training.config import PolicyConfig
from training.policy import ReferencePolicy


def test_bf16_checkpoint_is_synced_in_bf16(tmp_path):
    model_dir = build_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    policy = ReferencePolicy(PolicyConfig(pretrain=str(model_dir)))
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    assert {w.dtype for _, w in policy.named_weights()} == {torch.bfloat16}
    forced = ReferencePolicy(PolicyConfig(pretrain=str(model_dir), sync_dtype="float32"))
    assert {w.dtype for _, w in forced.named_weights()} == {torch.float32}


def test_bf16_copies_are_one_buffer_written_in_place_at_every_sync(tmp_path):
    """The float32 policy's bf16 copies stay at the same addresses sync
    after sync (over CUDA IPC the engines keep one mapping and pin no other
    copy) and hold the current weights."""
    model_dir = build_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    policy = ReferencePolicy(PolicyConfig(pretrain=str(model_dir)))
    first = policy.named_weights()
    addresses = [t.data_ptr() for _, t in first]
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.5)
    second = policy.named_weights()
    assert [t.data_ptr() for _, t in second] == addresses
    params = dict(policy.model.named_parameters())
    for name, sent in second:
        assert torch.equal(sent, params[name].detach().to(torch.bfloat16)), name
