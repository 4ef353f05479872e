"""Bucket planning and flat-buffer packing (no processes)."""

from __future__ import annotations

import pytest
import torch

from engines.weight_sync.formats.buckets import (
    ALIGN,
    PackedViews,
    iter_buckets,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from engines.weight_sync.formats.manifest import Manifest


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 3, generator=g)),
        ("b.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("c.steps", torch.arange(3, dtype=torch.int64)),
        ("d.scale", torch.tensor(2.5, dtype=torch.float16)),  # 0-dim
        ("e.big", torch.randn(40, 40, generator=g)),  # 6400 bytes: larger than a bucket
        ("f.empty", torch.zeros(0, 4)),
        ("g.tail", torch.randn(11, generator=g).to(torch.float64)),
    ]


@pytest.mark.parametrize("bucket_bytes", [64, 256, 1024, 1 << 20])
def test_pack_unpack_round_trip(bucket_bytes):
    tensors = mixed_tensors()
    plan = plan_buckets(Manifest.of(tensors), bucket_bytes)
    received = []
    for bucket, chunk in iter_buckets(plan, tensors):
        flat = pack_bucket(bucket, chunk)
        assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
        # What a receiver does: its own buffer, filled by the wire.
        wire = flat.clone()
        received += [(n, t.clone()) for n, t in unpack_bucket(bucket, wire)]
    assert [n for n, _ in received] == [n for n, _ in tensors]
    for (name, sent), (_, got) in zip(tensors, received, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape, name
        assert torch.equal(got, sent), name


def test_plan_respects_bucket_size_and_alignment():
    tensors = mixed_tensors()
    plan = plan_buckets(Manifest.of(tensors), 256)
    for bucket in plan.buckets:
        for entry in bucket.entries:
            assert entry.offset % ALIGN == 0
        if len(bucket.entries) > 1:
            assert bucket.nbytes <= 256
    big = [b for b in plan.buckets if any(e.param.name == "e.big" for e in b.entries)]
    assert len(big) == 1 and len(big[0].entries) == 1 and big[0].nbytes == 6400
    one = plan_buckets(Manifest.of(tensors), 1 << 20)
    assert len(one.buckets) == 1
    assert one.manifest() == Manifest.of(tensors)


def test_pack_refuses_a_tensor_that_disagrees_with_the_plan():
    tensors = mixed_tensors()
    plan = plan_buckets(Manifest.of(tensors), 1 << 20)
    wrong = dict(tensors)
    wrong["a.weight"] = torch.zeros(3, 7)
    with pytest.raises(ValueError, match="'a.weight'"):
        pack_bucket(plan.buckets[0], wrong)


def test_iter_buckets_refuses_out_of_order_weights():
    tensors = mixed_tensors()
    plan = plan_buckets(Manifest.of(tensors), 1 << 20)
    with pytest.raises(ValueError, match="'b.bias' arrived where the plan has 'a.weight'"):
        list(iter_buckets(plan, tensors[1:] + tensors[:1]))


def test_packed_views_pack_the_bucket_s_bytes_again_and_again():
    """A kept buffer (the LoRA sender's) packed by one fused copy holds what
    pack_bucket would, sync after sync, in the same memory, and strided
    sources (a transposed tensor) land contiguous."""
    tensors = mixed_tensors()
    tensors[0] = ("a.weight", torch.randn(3, 7).t())  # non-contiguous
    (bucket,) = plan_buckets(Manifest.of(tensors), 1 << 20).buckets
    packed = PackedViews(bucket, torch.zeros(bucket.nbytes, dtype=torch.uint8))
    address = packed.buffer.data_ptr()
    for step in range(2):
        changed = [(n, t + step if t.numel() else t) for n, t in tensors]
        packed.pack([t for _, t in changed])
        expected = pack_bucket(bucket, dict(changed))
        for entry in bucket.entries:  # the bytes of every entry (not the padding)
            span = slice(entry.offset, entry.offset + entry.param.nbytes)
            assert torch.equal(packed.buffer[span], expected[span]), entry.param.name
        assert packed.buffer.data_ptr() == address


def test_packed_views_refuse_a_buffer_or_tensors_that_do_not_fit():
    tensors = mixed_tensors()
    (bucket,) = plan_buckets(Manifest.of(tensors), 1 << 20).buckets
    with pytest.raises(ValueError, match=f"cannot hold {bucket.nbytes} bytes"):
        PackedViews(bucket, torch.zeros(bucket.nbytes - 1, dtype=torch.uint8))
    packed = PackedViews(bucket, torch.zeros(bucket.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"6 tensors for a bucket of {len(tensors)}"):
        packed.pack([t for _, t in tensors[:-1]])
