"""The trainer's weights in the dtype a sync sends (`SyncBuffer`), for a
policy whose master weights are in another (float32, sent as bf16).

Casting each parameter anew at every sync gives the sender new tensors at
new addresses every time. Over CUDA IPC the engines then open every tensor's
handle again at each sync, and the tensors they keep mapped pin a copy of
the model in the trainer's GPU memory beside the new one. One buffer,
allocated once and written in place at every sync, has the same addresses
every time: the engines map it once (one storage: one handle opened), copy
from it with their captured CUDA graph, and no other copy is pinned.
"""

from __future__ import annotations

from typing import Any

#: Each tensor starts this many bytes into the buffer, at least (aligned
#: views copy with the GPU's wide loads).
ALIGN_BYTES = 64


class SyncBuffer:
    """Casts named tensors into views of one flat buffer of `dtype`, made
    on the first call and again only when the names, shapes or device change."""

    def __init__(self, dtype: Any):
        self.dtype = dtype
        self._key: tuple | None = None
        self.flat: Any = None
        self._views: list[Any] = []

    def cast(self, weights: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """`weights` in `dtype`: the tensors themselves where all are of it,
        else views of the buffer holding their values (one fused copy). The
        views are written again by the next call: send them before that."""
        import torch

        weights = [(name, t.detach()) for name, t in weights]
        if all(t.dtype == self.dtype for _, t in weights):
            return weights
        key = tuple((name, tuple(t.shape)) for name, t in weights) + (weights[0][1].device,)
        if key != self._key:
            self._allocate([t for _, t in weights])
            self._key = key
        torch._foreach_copy_(self._views, [t for _, t in weights])
        return [(name, view) for (name, _), view in zip(weights, self._views, strict=True)]

    def _allocate(self, tensors: list[Any]) -> None:
        import torch

        align = max(1, ALIGN_BYTES // torch.empty(0, dtype=self.dtype).element_size())
        offsets, used = [], 0
        for t in tensors:
            offsets.append(used)
            used += -(-t.numel() // align) * align
        self.flat = None  # the old buffer goes before the new one is made
        self.flat = torch.empty(max(used, 1), dtype=self.dtype, device=tensors[0].device)
        self._views = [
            self.flat[offset : offset + t.numel()].view(t.shape)
            for t, offset in zip(tensors, offsets, strict=True)
        ]
