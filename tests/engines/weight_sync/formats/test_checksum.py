"""Checksums of tensors' bytes (no processes)."""

from __future__ import annotations

import torch

from engines.weight_sync.formats.checksum import checksum, checksums


def test_checksum_sees_any_changed_or_moved_byte():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert checksum(t) == checksum(t.clone())
    flipped = t.clone()
    flipped.view(torch.uint8)[1234] ^= 1
    assert checksum(flipped) != checksum(t)
    swapped = t.clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    assert checksum(swapped) != checksum(t)
    assert checksum(t[:-1]) != checksum(t)
    # Same bytes, any dtype or shape: the manifest checks those.
    assert checksum(t.view(10, 100)) == checksum(t)
    assert checksum(t.to(torch.bfloat16)) != checksum(t)


def test_checksum_sees_swapped_rows_and_odd_byte_layouts():
    rows = torch.randn(64, 448, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    swapped = rows.clone()
    swapped[[0, 63]] = swapped[[63, 0]]  # rows of 224 int32 words, far apart
    assert checksum(swapped) != checksum(rows)
    odd = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert checksum(odd) != checksum(torch.tensor([1, 2, 3, 0], dtype=torch.uint8))
    base = torch.arange(10, dtype=torch.uint8)
    assert checksum(base[1:5]) == checksum(base[1:5].clone())  # odd storage offset
    tensors = [("a", rows), ("b", odd), ("c", base[1:5])]
    assert checksums(tensors) == {name: checksum(t) for name, t in tensors}
