"""Checksums of tensors, equal on CPU and GPU for equal bytes.

The bytes are read as int32 words and laid out in rows of `_LANES` words; the
column sums (one read pass, int32 arithmetic that wraps, so the order of
additions does not matter and CPU and GPU agree) are folded into a plain sum
and a sum weighted by column. A changed word changes the plain sum; two
swapped words change the weighted one unless their distance is a multiple of
`_LANES` (a prime, so rows of a matrix are not). A fingerprint for verifying
a transfer at memory speed, not a cryptographic hash.

The sums stay on the tensor's device until `checksums` reads all of them in
one copy: no host round trip per tensor.
"""

from __future__ import annotations

from typing import Any

from engines.weight_sync.errors import ChecksumMismatchError

_LANES = 61
_MASK = 0xFFFFFFFF


def device_sums(tensor: Any):
    """The two sums of `tensor`'s bytes, as an int32 tensor of 2 on its device.
    No copy of the tensor (a whole bucket may be summed on an engine's
    critical path), unless its bytes start off a 4-byte boundary."""
    import torch

    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if flat.storage_offset() % 4:
        flat = flat.clone()
    whole = flat.numel() - flat.numel() % 4
    words = flat[:whole].view(torch.int32)
    body = words.numel() - words.numel() % _LANES
    if body:
        columns = words[:body].view(-1, _LANES).sum(0, dtype=torch.int32)
    else:
        columns = words.new_zeros(_LANES)
    tail = words[body:]
    if whole < flat.numel():  # the last 1-3 bytes, zero-padded to one more word
        last = flat.new_zeros(4)
        last[: flat.numel() - whole] = flat[whole:]
        tail = torch.cat([tail, last.view(torch.int32)])
    columns[: tail.numel()] += tail
    weights = torch.arange(1, _LANES + 1, dtype=torch.int32, device=words.device)
    return torch.stack([columns.sum(dtype=torch.int32), (columns * weights).sum(dtype=torch.int32)])


def render(nbytes: int, sums: list[int]) -> str:
    return f"{nbytes:x}-{sums[0] & _MASK:08x}-{sums[1] & _MASK:08x}"


def nbytes_of(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def checksum(tensor: Any) -> str:
    """Hex fingerprint of the tensor's bytes (dtype and shape not included:
    the manifest checks those)."""
    return render(nbytes_of(tensor), device_sums(tensor).tolist())


def checksums(named_tensors) -> dict[str, str]:
    """`{name: checksum}`, reading every sum back in one copy per device."""
    return finish_checksums({name: (nbytes_of(t), device_sums(t)) for name, t in named_tensors})


def finish_checksums(pending: dict[str, tuple[int, Any]]) -> dict[str, str]:
    """Render `{name: (nbytes, device_sums)}`: one host copy per device."""
    import torch

    by_device: dict[Any, list[str]] = {}
    for name, (_, sums) in pending.items():
        by_device.setdefault(sums.device, []).append(name)
    result = {}
    for names in by_device.values():
        values = torch.stack([pending[n][1] for n in names]).tolist()
        for name, sums in zip(names, values, strict=True):
            result[name] = render(pending[name][0], sums)
    return result


def raise_checksum_mismatch(
    engine: str, expected: dict[str, str], per_worker: list[dict[str, str | None]]
) -> None:
    """ChecksumMismatchError naming the worker and the first names that differ."""
    for rank, got in enumerate(per_worker):
        bad = [name for name, value in expected.items() if got.get(name) != value]
        if bad:
            raise ChecksumMismatchError(
                f"{engine} worker {rank}: {len(bad)} of {len(expected)} checksums differ "
                f"from the trainer's after the transfer, e.g. {bad[:3]}"
            )
