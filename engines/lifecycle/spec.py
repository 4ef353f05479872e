"""The one spec of an engine set (`EngineSetSpec`), checked on the driver
before anything exists.

Every error here is `EngineSpecError` naming the bad value: deterministic, so
the flow never retries it (`tasks.engines.retry_on_engine_failure` retries
`EngineFailure` only), and nothing is left to clean up. What depends on the
backend the cluster runs (`engine_kwargs_for`) is checked once it is known,
still before anything is created.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import os
import re
from typing import Annotated, Any

from pydantic import ConfigDict, field_validator, model_validator

from engines.config import EngineSettings, at_least
from engines.errors import EngineSpecError
from engines.lifecycle.actors import backend_class
from engines.lifecycle.placement import Placement
from engines.openrlhf.executor import check_agent_func_path

BACKENDS = ("auto", "vllm", "hf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# Engine arguments the spec sets from its own fields (named as
# `create_vllm_engines`' parameters): one in engine_kwargs as well would be
# ambiguous. Every engine setting is one, under its own name or vLLM's, so a
# new setting is reserved without an edit here.
RESERVED_ENGINE_KWARGS = {
    **{name: name for name in EngineSettings.model_fields if name != "engine_kwargs"},
    "model": "pretrain",
    "max_model_len": "max_len",
    "seed": "seed",
    "worker_extension_cls": None,  # ours carries the weight-sync API
}


class EngineSetSpec(EngineSettings):
    """An engine set: `num_engines` engines, each with these settings; engine
    i is the named actor `<name_prefix>-<i>` in `namespace` and samples with
    seed `seed + i`. Without `name_prefix` each set gets a prefix of its own.

    `spare_engines`: that many more engines on bundles reserved beside the
    set's, put to sleep once up (`engines.lifecycle.spares`). `prepared_actors`:
    that many actors with the imports done and no engine or GPU, each ready
    to take the place of an engine whose actor is lost
    (`engines.lifecycle.prepared`; TP=1). `sleep` (OpenRLHF's
    `vllm_enable_sleep`): the engines start in sleep mode and are put to
    sleep once up. `placement`: where the set goes (`Placement`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)  # Placement holds a Ray group

    num_engines: Annotated[int, at_least(1)]
    seed: int = 42
    backend: str = "auto"
    spare_engines: Annotated[int, at_least(0)] = 0
    prepared_actors: Annotated[int, at_least(0)] = 0
    sleep: bool = False
    name_prefix: str | None = None
    namespace: str | None = None
    placement: Placement = Placement()

    @field_validator("pretrain", mode="before")
    @classmethod
    def _model_exists(cls, pretrain: Any) -> Any:
        if not isinstance(pretrain, str) or not pretrain:
            raise EngineSpecError(f"pretrain must be a model path or hub id, got {pretrain!r}")
        check_pretrain(pretrain)
        return pretrain

    @field_validator("agent_func_path")
    @classmethod
    def _agent_loads(cls, path: str | None) -> str | None:
        if path is None:
            return None
        check_agent_func_path(path)
        return os.path.abspath(path)  # the engine actors' working directory is Ray's

    @field_validator("backend", mode="before")
    @classmethod
    def _known_backend(cls, backend: Any) -> Any:
        if backend not in BACKENDS:
            raise EngineSpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return backend

    @model_validator(mode="after")
    def _engine_arguments(self) -> EngineSetSpec:
        kwargs = self.engine_kwargs
        for name, ours in RESERVED_ENGINE_KWARGS.items():
            if name in kwargs:
                hint = f"; pass it as create_vllm_engines' {ours}=" if ours else ""
                raise EngineSpecError(
                    f"engine argument {name}={kwargs[name]!r} is set by create_vllm_engines{hint}"
                )
        if self.prepared_actors and self.tensor_parallel_size > 1:
            raise EngineSpecError(
                f"prepared_actors={self.prepared_actors} needs tensor_parallel_size=1, got "
                f"{self.tensor_parallel_size}: vLLM's Ray executor places TP workers from "
                "the engine actor's own bundles, which a prepared actor does not hold"
            )
        if self.sleep and kwargs.get("enable_sleep_mode") is False:
            raise EngineSpecError(
                "sleep=True (OpenRLHF: vllm_enable_sleep) and enable_sleep_mode=False "
                "contradict each other"
            )
        # Only with arguments to check: the field list imports vLLM's arg_utils,
        # most of vLLM, in this (driver) process.
        fields = vllm_engine_fields() if kwargs else frozenset()
        unknown = sorted(set(kwargs) - fields) if fields else []
        if unknown:
            raise EngineSpecError(
                f"unknown engine arguments {unknown}: vLLM's AsyncEngineArgs has no such field"
            )
        return self

    def engine_kwargs_for(self, backend: str) -> dict[str, Any]:
        """The engine arguments each engine gets on `backend` ("vllm" or "hf")."""
        kwargs = dict(self.engine_kwargs)
        if backend == "vllm" and self.spare_engines:
            # A spare sleeps, so it needs sleep mode; every engine of the set gets
            # it too: vLLM hashes it into the torch.compile cache key, and one key
            # lets the set, its spares and their successors share one warm cache.
            if kwargs.get("enable_sleep_mode") is False:
                raise EngineSpecError(
                    "spare_engines needs enable_sleep_mode (spares sleep until needed); "
                    "leave it unset or True"
                )
            kwargs["enable_sleep_mode"] = True
        if self.sleep:
            kwargs["enable_sleep_mode"] = True
        # What only the backend knows it accepts, asked of its class (not its actor).
        backend_class(backend).check_settings(kwargs, self.tool_call_parser)
        return kwargs


#: vLLM's engine-argument dataclasses: `AsyncEngineArgs(EngineArgs)`, both in this file.
VLLM_ARGS_FILE = ("engine", "arg_utils.py")
VLLM_ARGS_CLASSES = ("EngineArgs", "AsyncEngineArgs")


@functools.cache
def vllm_engine_fields() -> frozenset[str]:
    """Field names of vLLM's AsyncEngineArgs; empty when vLLM is not installed
    (then the engine itself rejects a bad one at start-up).

    Read from vLLM's source, not imported: importing `arg_utils` pulls in most
    of vLLM and torch (10-15 s, measured on an H200 host), which the driver
    paid on every engine start before the actors even existed. A source that
    no longer parses that way falls back to the import."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return frozenset()
    for root in spec.submodule_search_locations or ():
        path = os.path.join(root, *VLLM_ARGS_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as source:
                fields = dataclass_fields(source.read(), VLLM_ARGS_CLASSES)
            if fields:
                return fields
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(field.name for field in dataclasses.fields(AsyncEngineArgs))


def dataclass_fields(source: str, classes: tuple[str, ...]) -> frozenset[str]:
    """The dataclass fields that the top-level `classes` of `source` declare
    (annotated class attributes, minus `ClassVar`/`InitVar`, as
    `dataclasses.fields` counts them); empty when one of the classes is missing."""
    found: dict[str, set[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            found[node.name] = {
                statement.target.id
                for statement in node.body
                if isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and not re.search(r"\b(ClassVar|InitVar)\b", ast.unparse(statement.annotation))
            }
    if set(found) != set(classes):
        return frozenset()
    return frozenset().union(*found.values())


def check_pretrain(pretrain: str) -> None:
    if os.path.exists(pretrain):
        if not os.path.isfile(os.path.join(pretrain, "config.json")):
            raise EngineSpecError(
                f"pretrain={pretrain!r} has no config.json (not a model directory)"
            )
        return
    looks_like_path = pretrain.startswith(("/", ".", "~")) or not _HUB_ID.match(pretrain)
    if looks_like_path:
        raise EngineSpecError(f"pretrain={pretrain!r} does not exist")
