"""The HF checkpoint layout the checkpoint transport writes and reads
(formats/hf_checkpoint.py; engines loading it: test_session.py on a fake
engine, test_sync_into_engines.py on real ones)."""

from __future__ import annotations

import json

import pytest
import torch

from engines.weight_sync.formats import hf_checkpoint
from engines.weight_sync.formats.manifest import Manifest


def weights():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed.weight", torch.randn(16, 8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(16, 8, generator=g)),
    ]


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 600])
def test_checkpoint_round_trip(tmp_path, max_shard_bytes):
    path = hf_checkpoint.save(
        weights(), tmp_path / "ckpt", version=7, max_shard_bytes=max_shard_bytes
    )
    sharded = max_shard_bytes < 1000
    assert (path / hf_checkpoint.INDEX).exists() == sharded
    if sharded:
        index = json.loads((path / hf_checkpoint.INDEX).read_text())
        assert set(index["weight_map"]) == {n for n, _ in weights()}
        assert len(hf_checkpoint.shard_files(path)) == 2  # 512+16 bytes, then 512
    # safetensors orders tensors its own way; the layout is what must agree.
    assert hf_checkpoint.read_manifest(path).by_name() == Manifest.of(weights()).by_name()
    assert hf_checkpoint.read_version(path) == 7
    loaded = dict(hf_checkpoint.iter_tensors(path))
    for name, tensor in weights():
        assert torch.equal(loaded[name], tensor)


def test_plain_hf_checkpoint_has_no_version(tiny_model):
    assert hf_checkpoint.read_version(tiny_model) is None
    names = hf_checkpoint.read_manifest(tiny_model).names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


def test_a_directory_without_weights_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        hf_checkpoint.shard_files(tmp_path)
