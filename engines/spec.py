"""What `create_vllm_engines` checks on the driver, before anything exists.

Every error here is `EngineSpecError` naming the bad value: deterministic, so
the flow never retries it (`tasks.engines.retry_on_engine_failure` retries
`EngineFailure` only), and nothing is left to clean up.

OpenRLHF's keyword names (`create_vllm_engines` in
openrlhf/trainer/ray/vllm_engine.py, v0.11.2) are resolved here onto ours.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any

from engines.errors import EngineSpecError

BACKENDS = ("auto", "vllm", "hf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# Engine arguments `create_vllm_engines` sets from its own parameters: passing
# one in **engine_kwargs as well would be ambiguous.
RESERVED_ENGINE_KWARGS = {
    "model": "pretrain",
    "max_model_len": "max_len",
    "seed": "seed",
    "tensor_parallel_size": "tensor_parallel_size",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enable_prefix_caching": "enable_prefix_caching",
    "worker_extension_cls": None,  # ours carries the weight-sync API
}

# What the CPU backend does with engine arguments; the rest are vLLM-only
# (enforce_eager, enable_sleep_mode, ...) and ignored there.
HF_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class OpenRLHFKeywords:
    """OpenRLHF's names, beside the seed's (defaults: OpenRLHF's)."""

    max_model_len: int | None = None
    full_determinism: bool = False
    vllm_enable_sleep: bool = False
    logprobs_mode: str | None = None
    agent_func_path: str | None = None
    remote_rm_url: Any = None
    max_images_per_prompt: int = 0


def check_unsupported(openrlhf: OpenRLHFKeywords) -> None:
    """OpenRLHF features the engines do not have: a clear error, not a
    silently different run."""
    if openrlhf.agent_func_path is not None:
        raise EngineSpecError(
            f"agent_func_path={openrlhf.agent_func_path!r} is not supported: our engines run no "
            "agent executor inside the actor; run the executor in your own process against "
            "`engine.generate` (see the README's OpenRLHF section)"
        )
    if openrlhf.remote_rm_url is not None:
        raise EngineSpecError(
            f"remote_rm_url={openrlhf.remote_rm_url!r} is not supported: engines compute no "
            "rewards; score the outputs in your trainer"
        )
    if openrlhf.max_images_per_prompt:
        raise EngineSpecError(
            f"max_images_per_prompt={openrlhf.max_images_per_prompt!r} is not supported: "
            "the engines take text (token) prompts only"
        )


def resolve_max_len(max_len: Any, max_model_len: Any) -> Any:
    if max_len is None and max_model_len is None:
        raise EngineSpecError("max_len (OpenRLHF: max_model_len) is required")
    if max_len is not None and max_model_len is not None and max_len != max_model_len:
        raise EngineSpecError(
            f"max_len={max_len!r} and max_model_len={max_model_len!r} name the same limit "
            "and differ: pass one"
        )
    return max_len if max_len is not None else max_model_len


def resolve_engine_kwargs(
    engine_kwargs: dict[str, Any], openrlhf: OpenRLHFKeywords, backend: str
) -> dict[str, Any]:
    """The engine arguments each engine gets: ours plus OpenRLHF's, checked."""
    kwargs = dict(engine_kwargs)
    for name, ours in RESERVED_ENGINE_KWARGS.items():
        if name in kwargs:
            hint = f"; pass it as create_vllm_engines' {ours}=" if ours else ""
            raise EngineSpecError(
                f"engine argument {name}={kwargs[name]!r} is set by create_vllm_engines{hint}"
            )
    if openrlhf.vllm_enable_sleep:
        if kwargs.get("enable_sleep_mode") is False:
            raise EngineSpecError(
                "vllm_enable_sleep=True and enable_sleep_mode=False contradict each other"
            )
        kwargs["enable_sleep_mode"] = True
    if openrlhf.logprobs_mode:
        if kwargs.get("logprobs_mode", openrlhf.logprobs_mode) != openrlhf.logprobs_mode:
            raise EngineSpecError(
                f"logprobs_mode={openrlhf.logprobs_mode!r} given twice, differently"
            )
        # As OpenRLHF: the sampled token's logprob only.
        kwargs["logprobs_mode"] = openrlhf.logprobs_mode
        kwargs.setdefault("max_logprobs", 1)
    # Only with arguments to check: the field list imports vLLM's arg_utils,
    # most of vLLM, in this (driver) process.
    fields = vllm_engine_fields() if kwargs else frozenset()
    unknown = sorted(set(kwargs) - fields) if fields else []
    if unknown:
        raise EngineSpecError(
            f"unknown engine arguments {unknown}: vLLM's AsyncEngineArgs has no such field"
        )
    if backend == "hf":
        check_hf_kwargs(kwargs)
    return kwargs


def check_hf_kwargs(kwargs: dict[str, Any]) -> None:
    dtype = kwargs.get("dtype", "auto")
    if dtype not in HF_DTYPES:
        raise EngineSpecError(f"dtype={dtype!r} is not one of {list(HF_DTYPES)} (backend 'hf')")
    mode = kwargs.get("logprobs_mode", LOGPROBS_MODES[0])
    if mode not in LOGPROBS_MODES:
        raise EngineSpecError(
            f"logprobs_mode={mode!r} is not supported by backend 'hf'; use one of "
            f"{list(LOGPROBS_MODES)}"
        )


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


def check_spec(
    num_engines: Any,
    pretrain: Any,
    max_len: Any,
    gpu_memory_utilization: Any,
    tensor_parallel_size: Any,
    backend: Any,
) -> None:
    def whole(name: str, value: Any, least: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise EngineSpecError(f"{name} must be an integer >= {least}, got {value!r}")

    whole("num_engines", num_engines, 1)
    whole("tensor_parallel_size", tensor_parallel_size, 1)
    whole("max_len", max_len, 2)
    if gpu_memory_utilization is not None and (
        isinstance(gpu_memory_utilization, bool)
        or not isinstance(gpu_memory_utilization, int | float)
        or not 0 < gpu_memory_utilization <= 1
    ):
        raise EngineSpecError(
            f"gpu_memory_utilization must be in (0, 1] or None (vLLM's default), "
            f"got {gpu_memory_utilization!r}"
        )
    if backend not in BACKENDS:
        raise EngineSpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(pretrain, str) or not pretrain:
        raise EngineSpecError(f"pretrain must be a model path or hub id, got {pretrain!r}")
    check_pretrain(pretrain)
