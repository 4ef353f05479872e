"""The manifest: names, shapes and dtypes of the parameters a sync carries.

The trainer sends it before any byte moves; each engine compares it with its
own and refuses on the first difference, naming the parameter. Dtypes are
torch attribute names ("float32", "bfloat16"), as in vLLM's weight transfer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engines.weight_sync.errors import ManifestMismatchError


def dtype_name(dtype: Any) -> str:
    """`torch.float32` / "torch.float32" / "float32" -> "float32"."""
    import torch

    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if isinstance(getattr(torch, name, None), torch.dtype):
            return str(getattr(torch, name)).removeprefix("torch.")
    raise ValueError(f"{dtype!r} is not a torch dtype or a torch dtype name")


def torch_dtype(name: str):
    import torch

    return getattr(torch, dtype_name(name))


class ParamSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    dtype: str
    shape: tuple[int, ...]

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> str:
        return dtype_name(value)

    @field_validator("shape")
    @classmethod
    def _shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 for d in value):
            raise ValueError(f"shape has a negative dimension: {value}")
        return value

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch_dtype(self.dtype).itemsize


class Manifest(BaseModel):
    """Parameters in the order they are sent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: tuple[ParamSpec, ...]

    @field_validator("params")
    @classmethod
    def _unique(cls, value: tuple[ParamSpec, ...]) -> tuple[ParamSpec, ...]:
        seen: set[str] = set()
        for spec in value:
            if spec.name in seen:
                raise ValueError(f"parameter {spec.name!r} appears twice in the manifest")
            seen.add(spec.name)
        return value

    @classmethod
    def of(cls, named_tensors: Iterable[tuple[str, Any]]) -> Manifest:
        return cls(
            params=tuple(
                ParamSpec(name=name, dtype=t.dtype, shape=tuple(t.shape))
                for name, t in named_tensors
            )
        )

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    # Cached (the model is frozen): a sync asks for both, and each walks
    # every parameter.
    @cached_property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @cached_property
    def plain(self) -> dict:
        """The manifest as plain data (what crosses to the engines)."""
        return self.model_dump(mode="json")

    def by_name(self) -> dict[str, ParamSpec]:
        return {p.name: p for p in self.params}

    def digest(self) -> str:
        """A short fingerprint of the layout (not of the values)."""
        blob = json.dumps([[p.name, p.dtype, list(p.shape)] for p in self.params]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


#: Parameters with one row per token (input embeddings, output head).
VOCAB_PARAMS = (
    "embed_tokens.weight",
    "lm_head.weight",
    "wte.weight",
    "embed_in.weight",
    "embed_out.weight",
)


def _vocab_rows(name: str, mine: ParamSpec, spec: ParamSpec) -> str | None:
    """A clear line for a vocabulary resize (the trainer added tokens), or None."""
    if not name.endswith(VOCAB_PARAMS) or len(mine.shape) != 2 or len(spec.shape) != 2:
        return None
    if mine.shape[1] != spec.shape[1] or mine.shape[0] == spec.shape[0]:
        return None
    return (
        f"{name!r}: the trainer sends {spec.shape[0]} vocabulary rows, the engine holds "
        f"{mine.shape[0]} (the trainer's embeddings were resized, e.g. for new tokens); "
        "a sync cannot change the vocabulary size: save the resized model and tokenizer, "
        "and create the engines from that checkpoint"
    )


def mismatches(expected: Manifest, got: Manifest, *, allow_partial: bool = False) -> list[str]:
    """Every difference between the engine's manifest (`expected`) and the
    trainer's (`got`), one readable line each; empty when they agree."""
    want = expected.by_name()
    problems = []
    for spec in got.params:
        mine = want.get(spec.name)
        if mine is None:
            problems.append(f"{spec.name!r}: the engine has no such parameter")
        elif mine.shape != spec.shape:
            problems.append(
                _vocab_rows(spec.name, mine, spec)
                or f"{spec.name!r}: shape {list(spec.shape)} from the trainer, "
                f"{list(mine.shape)} on the engine"
            )
        elif mine.dtype != spec.dtype:
            problems.append(
                f"{spec.name!r}: dtype {spec.dtype} from the trainer, {mine.dtype} on the engine"
            )
    if not allow_partial:
        sent = {p.name for p in got.params}
        missing = [name for name in want if name not in sent]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            problems.append(f"the trainer does not send {shown}{more}")
    return problems


def raise_problems(engine: str, problems: list[str]) -> None:
    """Raise ManifestMismatchError naming the first of `problems` (the lines
    of `mismatches`, from one or several workers); nothing when empty."""
    if problems:
        shown = "; ".join(dict.fromkeys(problems[:5]))
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ManifestMismatchError(f"engine {engine}: weight manifest mismatch: {shown}{more}")
