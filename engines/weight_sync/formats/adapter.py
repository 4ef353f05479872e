"""A LoRA adapter as weight sync moves it (`lora/`): its shape
(`LoraSpec`: rank, alpha, target modules, as peft's `LoraConfig`), what a
trainer of one tells its sender (`LoraSync`), its names on the engines, and
the peft adapter directory the checkpoint way writes, and the tensors as a
worker receives them (`received_tensors`); and the store a worker keeps its
adapters in (`AdapterStore`), which each backend implements.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.formats import ipc_handles as ipc
from engines.weight_sync.formats.buckets import Bucket, unpack_bucket

#: How an adapter's tensors reach the engines (`lora/`): a CUDA IPC buffer,
#: a peft adapter directory, or safetensors bytes inside the call.
VIAS = ("cuda_ipc", "checkpoint", "inline")
#: The files of a peft adapter directory.
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's shape: what peft's `LoraConfig` and vLLM's `PEFTHelper` need."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {self.alpha!r}")
        if not self.target_modules or not all(
            isinstance(m, str) and m for m in self.target_modules
        ):
            raise ValueError(
                f"target_modules must be non-empty module names, got {self.target_modules!r}"
            )

    @classmethod
    def of(cls, plain: dict) -> LoraSpec:
        return cls(int(plain["rank"]), float(plain["alpha"]), tuple(plain["target_modules"]))

    def plain(self) -> dict:
        return {**asdict(self), "target_modules": list(self.target_modules)}

    def peft_config(self) -> dict:
        """As peft writes `adapter_config.json` (the keys vLLM reads)."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "bias": "none",
        }

    def check_tensors(self, weights: list[tuple[str, Any]]) -> None:
        """Each tensor is a `lora_A` (rank rows) or `lora_B` (rank columns)."""
        for name, tensor in weights:
            if ".lora_A." in name:
                rank = tensor.shape[0]
            elif ".lora_B." in name:
                rank = tensor.shape[-1]
            else:
                raise ValueError(f"{name!r} is not a LoRA tensor (lora_A / lora_B, peft's names)")
            if rank != self.rank:
                raise ValueError(f"{name!r} has rank {rank}, the adapter's is {self.rank}")


@dataclass(frozen=True)
class LoraSync:
    """What a trainer that trains an adapter tells its sender: the adapter's
    shape, and how many adapter versions each engine keeps loaded."""

    spec: LoraSpec
    keep: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {self.keep!r}")


def adapter_name(version: int) -> str:
    return f"rolloutflow-v{version}"


def adapter_id(version: int) -> int:
    # vLLM's ids start at 1; version 0 may be an adapter too.
    return version + 1


def targets_missing(spec: LoraSpec, module_names: list[str]) -> list[str]:
    """The target modules that name no module (peft matches a name or its suffix)."""
    return [
        t
        for t in spec.target_modules
        if not any(n == t or n.endswith("." + t) for n in module_names)
    ]


def tensor_module(name: str) -> str:
    """`...self_attn.q_proj.lora_A.weight` -> `q_proj`."""
    return name.split(".lora_", 1)[0].rsplit(".", 1)[-1]


def save_adapter(weights: list[tuple[str, Any]], spec: LoraSpec, path: str | Path) -> Path:
    """A peft adapter directory (what `PeftModel.from_pretrained` and vLLM's
    `LoRARequest` load)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous().cpu() for n, t in weights}, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(spec.peft_config()))
    return path


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter's tensors in one flat byte buffer laid out by `bucket`
    (`buckets.py`, as the broadcast packs its buckets). Over CUDA IPC the
    buffer is the trainer's, mapped, and written again at its next sync: a
    store copies it (`copy_into`) and never keeps it."""

    buffer: Any  # uint8, at least bucket.nbytes
    bucket: Bucket

    def names(self) -> list[str]:
        return [e.param.name for e in self.bucket.entries]

    # Cached: a worker keeps the mapped adapter across syncs, and summing
    # every entry's size in Python each sync was a measurable part of a
    # LoRA sync (docs/weight_sync.md).
    @functools.cached_property
    def nbytes(self) -> int:
        return sum(e.param.nbytes for e in self.bucket.entries)

    def copy_into(self) -> tuple[Any, dict[str, Any]]:
        """A new buffer holding a copy of the bytes, and the adapter's
        tensors as views of it."""
        own = self.buffer[: self.bucket.nbytes].clone()
        return own, dict(unpack_bucket(self.bucket, own))

    def copy_bytes(self, own: Any) -> None:
        """The bytes into `own`, a buffer whose views are built already: no
        views made again (a view per tensor, 336 of them for a rank-16
        adapter on a 0.5B model, was most of a refill's time)."""
        own.copy_(self.buffer[: self.bucket.nbytes])


def received_tensors(worker: Any, via: str, payload: Any) -> dict[str, Any] | PackedAdapter:
    """The adapter's tensors, on this worker's device, owned by it; over
    CUDA IPC the trainer's buffer, mapped once (the store copies it)."""
    if via == "inline":
        from safetensors.torch import load

        return {n: t.to(worker.device) for n, t in load(payload).items()}
    if via == "checkpoint":
        from safetensors.torch import load_file

        return load_file(str(Path(payload, WEIGHTS_FILE)), device=str(worker.device))
    opened = ipc.loads(payload)
    held = worker.held.get("lora_ipc")  # (mapping, PackedAdapter)
    if opened["handles"] is not None:
        bucket = Bucket.model_validate(opened["bucket"])
        mapped = ipc.open_shared(opened["handles"], worker.device.index)
        if mapped.element_size() != 1 or mapped.numel() < bucket.nbytes:
            raise WeightTransferError(
                f"the adapter buffer is {mapped.dtype} x {mapped.numel()}, announced "
                f"{bucket.nbytes} bytes"
            )
        held = worker.held["lora_ipc"] = (opened["mapping"], PackedAdapter(mapped, bucket))
    elif held is None or held[0] != opened["mapping"]:
        raise WeightTransferError(
            f"this worker does not hold the adapter buffer {opened['mapping']!r}; the "
            "trainer must send its handle again"
        )
    return held[1]


class AdapterStore(ABC):
    """A worker's LoRA adapters, one per weight version. Each backend
    implements it (vLLM's LoRA manager: `engines/vllm/adapters.py`; peft on
    the CPU backend: `engines/hf/adapters.py`), and its worker makes one
    (`new_adapter_store`, asked by `lora/worker.py` on the first adapter)."""

    #: The seconds of the last `load`'s parts by name (`*_s`), which the
    #: sync's report carries; a store that times none leaves it empty.
    times: dict[str, float] = {}  # replaced by each load, never mutated

    @abstractmethod
    def problems(
        self, spec: LoraSpec, names: list[str], version: int, remove: list[int]
    ) -> list[str]:
        """Why the adapter of `version` (tensors `names`) cannot be loaded
        once `remove` are removed, one line each; none when it can."""

    @abstractmethod
    def load(
        self,
        version: int,
        spec: LoraSpec,
        tensors: dict[str, Any] | PackedAdapter,
        remove: list[int],
    ) -> None:
        """Register the adapter of `version` built from `tensors` (a packed
        one is copied, never kept), and remove those of `remove`."""

    @abstractmethod
    def loaded(self) -> list[str]:
        """The adapters held, by name (`adapter_name`)."""
