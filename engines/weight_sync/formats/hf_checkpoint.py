"""The HF checkpoint layout in safetensors, as the checkpoint transport
writes and reads it (`transports/checkpoint.py`) and a worker reads the
layout its engine loaded (`worker_manifest.py`).

`save` writes `model.safetensors`, or shards plus `model.safetensors.index.json`
when larger than `max_shard_bytes`; the weight version travels in the
safetensors metadata. `read_manifest` reads only the headers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from engines.weight_sync.formats.manifest import Manifest, ParamSpec

logger = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
VERSION_KEY = "rolloutflow_weight_version"
# safetensors' dtype codes -> torch attribute names.
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def shard_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory, in index order."""
    root = Path(path)
    if (root / INDEX).is_file():
        index = json.loads((root / INDEX).read_text())
        return [root / name for name in dict.fromkeys(index["weight_map"].values())]
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {root}")
    return files


def _header(file: Path) -> dict[str, Any]:
    with open(file, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(size))


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Names, shapes and dtypes from the headers, without reading tensors."""
    params = []
    for file in shard_files(path):
        for name, entry in _header(file).items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{file}: {name!r} has unsupported dtype {entry['dtype']}")
            params.append(ParamSpec(name=name, dtype=dtype, shape=tuple(entry["shape"])))
    return Manifest(params=tuple(params))


def read_version(path: str | os.PathLike) -> int | None:
    """The weight version `save` stored, or None for a plain HF checkpoint."""
    meta = _header(shard_files(path)[0]).get("__metadata__") or {}
    value = meta.get(VERSION_KEY)
    return int(value) if value is not None else None


def iter_tensors(path: str | os.PathLike, device: str = "cpu") -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every weight, one shard in memory at a time."""
    from safetensors import safe_open

    for file in shard_files(path):
        with safe_open(str(file), framework="pt", device=device) as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, shard.get_tensor(name)


def save(
    named_tensors: Iterable[tuple[str, Any]],
    path: str | os.PathLike,
    *,
    version: int | None = None,
    max_shard_bytes: int = 5 << 30,
) -> Path:
    """Write the tensors in the HF layout; atomic per file (write, then rename)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    metadata = {"format": "pt"}
    if version is not None:
        metadata[VERSION_KEY] = str(int(version))
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name in (SINGLE, INDEX):
        (root / name).unlink(missing_ok=True)
    for name, shard in zip(names, shards, strict=True):
        tmp = root / f".{name}.tmp"
        save_file(shard, str(tmp), metadata=metadata)
        tmp.rename(root / name)
    if len(shards) > 1:
        weight_map = {t: file for file, shard in zip(names, shards, strict=True) for t in shard}
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / INDEX).write_text(json.dumps(index, indent=2))
    logger.info("wrote %d tensors in %d file(s) to %s", sum(map(len, shards)), len(shards), root)
    return root
