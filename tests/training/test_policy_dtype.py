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
