"""`SyncBuffer`: a float32 trainer's weights cast into one buffer kept across syncs."""

from __future__ import annotations

import torch

from training.sync_buffer import ALIGN_BYTES, SyncBuffer


def weights(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(5, 3, generator=g) * scale),
        ("b.bias", torch.randn(7, generator=g) * scale),
        ("c.weight", (torch.randn(4, 6, generator=g) * scale).t()),  # strided
    ]


def test_casts_into_aligned_views_of_one_buffer_reused_while_the_layout_holds():
    buffer = SyncBuffer(torch.bfloat16)
    first = buffer.cast(weights())
    storage = buffer.flat.untyped_storage().data_ptr()
    for (name, sent), (_, source) in zip(first, weights(), strict=True):
        assert sent.untyped_storage().data_ptr() == storage, name
        assert sent.data_ptr() % ALIGN_BYTES == 0, name
        assert torch.equal(sent, source.to(torch.bfloat16)), name
    again = buffer.cast(weights(2.0))
    assert [t.data_ptr() for _, t in again] == [t.data_ptr() for _, t in first]
    assert torch.equal(again[1][1], (weights(2.0)[1][1]).to(torch.bfloat16))
    # Another layout: a new buffer that fits it.
    grown = buffer.cast([*weights(), ("d.extra", torch.ones(100))])
    assert grown[-1][1].shape == (100,) and torch.equal(grown[-1][1], torch.ones(100).bfloat16())


def test_weights_already_in_the_dtype_are_sent_as_they_are():
    buffer = SyncBuffer(torch.float32)
    source = weights()
    sent = buffer.cast(source)
    assert [t.data_ptr() for _, t in sent] == [t.data_ptr() for _, t in source]
    assert buffer.flat is None
