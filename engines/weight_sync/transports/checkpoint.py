"""Transport: a checkpoint directory in the HF layout (safetensors), for
trainers outside the cluster, which write a directory the engines can read.

`save` writes `model.safetensors`, or shards plus `model.safetensors.index.json`
when larger than `max_shard_bytes`; the weight version travels in the
safetensors metadata. `read_manifest` reads only the headers.

Trainer: `CheckpointSender` (`save`, then `sync_from_checkpoint(engines,
path)`: two-phase; begin rides on the load call, and a single engine without
`verify` commits in it too). Engine actor: `load_weights_from_path`,
`load_checkpoint` (one engine, by itself). Worker: `load_weights_from_path`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.weight_sync.config import SyncConfig
from engines.weight_sync.coordinator import Coordinator, Phases, as_engine_list
from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats.checksum import checksums, nbytes_of
from engines.weight_sync.formats.manifest import Manifest, ParamSpec
from engines.weight_sync.probe import ProbeReference
from engines.weight_sync.protocol import (
    Committed,
    Received,
    SenderOptions,
    SyncReport,
    Transport,
    WorkerAnswer,
)

if TYPE_CHECKING:  # both import this module
    from engines.weight_sync.session import WeightSync
    from engines.weight_sync.worker import WorkerWeights

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


# --- trainer side --------------------------------------------------------------------------
def sync_from_checkpoint(
    engines: list[Any],
    path: str,
    version: int | None = None,
    config: SyncConfig | None = None,
    probe: ProbeReference | None = None,
) -> SyncReport:
    """Engines load a safetensors checkpoint directory (HF layout) that a
    trainer outside the cluster wrote (`save`); two-phase like the other
    transports. The version is `version`, else the one stored in the checkpoint."""
    config = config or SyncConfig()
    manifest = read_manifest(path)
    if version is None:
        version = read_version(path)
        if version is None:
            raise WeightSyncError(f"{path} stores no weight version; pass version=")
    coordinator = Coordinator(engines, config, probe)
    phases = Phases()
    received = coordinator.begin_and_receive(
        version,
        manifest,
        "load_weights_from_path",
        (str(path), config.verify),
        verified=config.verify,
    )
    phases.engines_reported(received, "pause_s", "call_s")
    phases.done("transfer")
    if config.verify:
        coordinator.check_received(version, checksums(iter_tensors(path)), received)
        phases.done("verify")
    if not received[0].committed:
        coordinator.finish(version)
        phases.done("finish")
    return phases.report(
        version,
        "checkpoint",
        len(engines),
        nbytes=manifest.nbytes,
        verified=config.verify,
        probe=coordinator.probe_result(),
    )


class CheckpointSender:
    """For a trainer that hands its weights over as a directory the engines
    can read: each sync writes `<directory>/v<version>` (`save`) and the
    engines load it (`sync_from_checkpoint`)."""

    transport = "checkpoint"

    def __init__(self, config: SyncConfig | None = None, *, directory: str):
        self.config = config or SyncConfig()
        self.directory = directory
        self.engines: list[Any] = []

    def init(self, engines: list[Any]) -> None:
        # Nothing to connect: the engines read the directory at each sync.
        self.engines = as_engine_list(engines)

    def summary(self) -> dict[str, Any]:
        return {}

    def sync(
        self,
        weights: Iterable[tuple[str, Any]],
        version: int,
        probe: ProbeReference | None = None,
    ) -> SyncReport:
        path = os.path.join(self.directory, f"v{version:06d}")
        save(weights, path, version=version)
        return sync_from_checkpoint(self.engines, path, version, self.config, probe)

    def close(self) -> None:
        self.engines = []


def new_sender(options: SenderOptions) -> CheckpointSender:
    if not options.checkpoint_dir:
        raise ValueError("transport 'checkpoint' needs checkpoint_dir")
    return CheckpointSender(options.config, directory=options.checkpoint_dir)


# --- engine actor --------------------------------------------------------------------------
async def load_weights_from_path(sync: WeightSync, path: str, verify: bool = True) -> Received:
    """Load a safetensors checkpoint directory (HF layout) into the open sync."""
    return await sync.receive("load_weights_from_path", str(path), bool(verify))


async def load_checkpoint(
    sync: WeightSync,
    path: str,
    version: int | None = None,
    *,
    on_failure: str = "restore",
    verify: bool = True,
) -> Committed:
    """Begin, load `path`, finish - on this engine alone (several engines at
    once: `sync_from_checkpoint`)."""
    if version is None:
        version = read_version(path) or sync.host.weight_version + 1
    manifest = read_manifest(path).model_dump(mode="json")
    await sync.begin_weight_sync(version, manifest, on_failure=on_failure, allow_partial=True)
    await load_weights_from_path(sync, path, verify=verify)
    return await sync.finish_weight_sync(version)


# --- worker --------------------------------------------------------------------------------
def worker_load_path(worker: WorkerWeights, path: str, verify: bool = True) -> dict:
    """Load every weight of a safetensors checkpoint (HF layout)."""
    started = time.monotonic()
    nbytes = 0
    for name, tensor in iter_tensors(path, device="cpu"):
        weight = tensor.to(worker.device)
        if verify:
            worker.record_wire([(name, weight)])
        worker.load([(name, weight)])
        nbytes += nbytes_of(tensor)
    worker.empty_cache()
    return worker.answer(
        WorkerAnswer(bytes=nbytes, times={"load_s": time.monotonic() - started}), verify
    )


TRANSPORT = Transport(
    "checkpoint",
    engine_methods={
        "load_weights_from_path": load_weights_from_path,
        "load_checkpoint": load_checkpoint,
    },
    worker_methods={"load_weights_from_path": worker_load_path},
    one_call=("load_weights_from_path",),
    new_sender=new_sender,
)
