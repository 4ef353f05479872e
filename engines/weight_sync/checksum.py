"""Checksums of tensors, equal on CPU and GPU for equal bytes.

The bytes are read as int16 words and summed with exact int64 arithmetic on
the tensor's own device (no copy to the host): a plain sum, and a sum
weighted by each word's position in its chunk, chained across chunks (Horner
step modulo a Mersenne prime). A changed, dropped or moved word changes the
result. A fingerprint for verifying a transfer, not a cryptographic hash.
"""

from __future__ import annotations

from typing import Any

# Words per chunk: |word| < 2**15 and weights <= 2**22 keep a chunk's weighted
# sum below 2**59, inside int64.
_CHUNK = 1 << 22
_MOD = (1 << 61) - 1
_MULT = 1_000_003
_weights: dict[Any, Any] = {}


def _position_weights(device: Any):
    import torch

    weights = _weights.get(device)
    if weights is None:
        weights = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device)
        _weights[device] = weights
    return weights


def checksum(tensor: Any) -> str:
    """Hex fingerprint of the tensor's bytes (dtype and shape not included:
    the manifest checks those)."""
    import torch

    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    nbytes = flat.numel()
    if nbytes % 2 or flat.storage_offset() % 2:
        flat = torch.cat([flat, flat.new_zeros(nbytes % 2)])
    words = flat.view(torch.int16)
    weights = _position_weights(words.device)
    total, chained = 0, 0
    for start in range(0, words.numel(), _CHUNK):
        part = words[start : start + _CHUNK].to(torch.int64)
        total += int(part.sum())
        weighted = int((part * weights[: part.numel()]).sum())
        chained = (chained * _MULT + weighted) % _MOD
    return f"{nbytes:x}-{total % _MOD:x}-{chained:x}"


def checksums(named_tensors) -> dict[str, str]:
    return {name: checksum(t) for name, t in named_tensors}
