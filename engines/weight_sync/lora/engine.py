"""The engine actor's side of a LoRA adapter's sync: the adapter versions
it keeps (`AdapterVersions`: a request runs to its end on the adapter it
was admitted under), the checks of an adapter's shape, and the methods a
trainer calls (`receive_lora_adapter`, `release_lora_buffer`,
`lora_adapters`); vLLM's native API reaches `load_adapter` too.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.formats.adapter import VIAS, LoraSpec, tensor_module
from engines.weight_sync.protocol import Received
from engines.weight_sync.session import WeightSync


class AdapterVersions:
    """The engine actor's adapters: the versions loaded (oldest first) and
    how many requests run on each, so none is removed under a request."""

    def __init__(self) -> None:
        self.loaded: list[int] = []
        self.running: Counter[int | None] = Counter()

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[int | None]:
        """The adapter a request admitted at `version` runs on (None: the
        base model), held for as long as the request runs."""
        adapter = version if version in self.loaded else None
        self.running[adapter] += 1
        try:
            yield adapter
        finally:
            self.running[adapter] -= 1

    def to_remove(self, version: int, keep: int, served: int) -> list[int]:
        """Versions outside the last `keep` once `version` is loaded, and
        idle. The version `served` stays until this sync commits: if it
        fails, the engine serves it on."""
        window = {*sorted({*self.loaded, version})[-keep:], served}
        return [v for v in self.loaded if v not in window and not self.running[v]]


def adapter_versions(sync: WeightSync) -> AdapterVersions:
    return sync.held.setdefault("lora", AdapterVersions())


def checked_spec(sync: WeightSync, spec: dict) -> LoraSpec:
    """`spec` as this engine takes it: LoRA enabled, a rank within its max."""
    config = sync.host.config
    if not getattr(config, "enable_lora", False):
        raise WeightSyncError(f"engine {sync.name} was started without enable_lora=True")
    try:
        checked = LoraSpec.of(spec)
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightSyncError(f"engine {sync.name}: bad adapter {spec!r}: {exc}") from exc
    if checked.rank > config.max_lora_rank:
        raise WeightSyncError(
            f"engine {sync.name}: adapter rank {checked.rank} is above its "
            f"max_lora_rank={config.max_lora_rank}"
        )
    return checked


async def load_adapter(sync: WeightSync, keep: int, method: str, *args: Any) -> Received:
    """Run the worker receive `method(*args, version, remove)` of the open
    sync's adapter; `remove`: the versions older than the last `keep` that no
    request runs on."""
    session = sync.session()
    versions = adapter_versions(sync)
    remove = versions.to_remove(session.version, int(keep), sync.host.weight_version)
    received = await sync.receive(method, *args, session.version, remove, session=session)
    versions.loaded = sorted((set(versions.loaded) - set(remove)) | {session.version})
    return received


async def receive_lora_adapter(
    sync: WeightSync, version: int, spec: dict, via: str, payload: Any, keep: int
) -> Received:
    """Load the adapter of `version` (the sync's), `via` one of `VIAS`."""
    checked = checked_spec(sync, spec)
    if via not in VIAS:
        raise WeightSyncError(f"via must be one of {VIAS}, got {via!r}")
    sync.session(version)
    return await load_adapter(sync, keep, "receive_lora_adapter", checked.plain(), via, payload)


# vLLM's native API (`vllm_native.update_weights`) carrying an adapter.
def is_adapter(names: list[str]) -> bool:
    return bool(names) and all(".lora_A." in n or ".lora_B." in n for n in names)


def native_spec(sync: WeightSync, names: list[str], shapes: list[list[int]]) -> LoraSpec:
    """vLLM's API carries named tensors only: the rank is lora_A's rows, the
    targets are the names' modules, and the scaling is 1 (alpha = rank: the
    trainer sends lora_B scaled by its alpha / rank)."""
    ranks = {int(s[0]) for n, s in zip(names, shapes, strict=True) if ".lora_A." in n}
    if len(ranks) != 1:
        raise WeightSyncError(f"engine {sync.name}: an adapter has one rank, got {sorted(ranks)}")
    rank = ranks.pop()
    targets = sorted({tensor_module(n) for n in names})
    return checked_spec(sync, {"rank": rank, "alpha": rank, "target_modules": targets})


def native_keep(sync: WeightSync) -> int:
    """Over vLLM's API no trainer says how many versions to keep: as many as
    the engine's `max_loras` (an engine argument; default 1)."""
    return int(sync.host.config.engine_kwargs.get("max_loras", 1))


async def lora_adapters(sync: WeightSync) -> list[str]:
    """The adapters rank 0's worker holds, by name (`adapter_name`)."""
    return (await sync.rpc("lora_adapters"))[0]


async def release_lora_buffer(sync: WeightSync) -> None:
    """Drop the trainer's adapter buffer the workers keep mapped."""
    await sync.rpc("release_lora_buffer")
