"""`create_vllm_engines` and `batch_vllm_engine_call`, API-compatible with
OpenRLHF's `openrlhf.trainer.ray.vllm_engine` module (v0.11.2): its keyword
names translated into an `EngineSetSpec`.

`max_model_len` is `max_len`; `vllm_enable_sleep=True` starts the engines in
sleep mode and puts them to sleep once up (the call then waits for them);
`full_determinism` sets OpenRLHF's `VLLM_ENABLE_V1_MULTIPROCESSING=0` in the
engines; `logprobs_mode` sets vLLM's, with `max_logprobs=1`;
`gpu_memory_utilization=None` is vLLM's default. `agent_func_path` is run
as OpenRLHF runs it (`engines.openrlhf.agents`); `remote_rm_url` (unused by
OpenRLHF beside an `agent_func_path`, where its CLI sets it to "agent") and
`max_images_per_prompt` are refused: a clear error, not a silently different
run. Ours beside them: `backend`, `spare_engines`, `prepared_actors`
(`engines.lifecycle.prepared`) and `colocate_trainer`
(`engines.lifecycle.placement.PlacementMode`).
"""

from __future__ import annotations

import sys
from typing import Any

from ray.util.placement_group import PlacementGroup

from engines.client import call_engines, raise_first_error
from engines.errors import EngineSpecError
from engines.lifecycle.engine_set import start_engine_set
from engines.lifecycle.handles import EngineSet
from engines.lifecycle.placement import Placement
from engines.lifecycle.spec import EngineSetSpec


def create_vllm_engines(
    num_engines: int,
    pretrain: str,
    max_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = 1,
    seed: int = 42,
    enable_prefix_caching: bool = False,
    *,
    backend: str = "auto",
    name_prefix: str | None = None,
    namespace: str | None = None,
    shared_pg: PlacementGroup | None = None,
    max_model_len: int | None = None,
    full_determinism: bool = False,
    vllm_enable_sleep: bool = False,
    logprobs_mode: str | None = None,
    agent_func_path: str | None = None,
    remote_rm_url: Any = None,
    max_images_per_prompt: int = 0,
    spare_engines: int = 0,
    prepared_actors: int = 0,
    colocate_trainer: bool = False,
    **engine_kwargs: Any,
) -> EngineSet:
    """Start `num_engines` rollout engines (`start_engine_set`); engine i is
    named `<name_prefix>-<i>` in `namespace` and samples with seed `seed + i`.
    `engine_kwargs` are vLLM engine arguments (`enforce_eager`, `dtype`, ...).
    Every check runs here, before anything is created (`EngineSpecError`)."""
    check_unsupported(agent_func_path, remote_rm_url, max_images_per_prompt)
    # The seed's names are the spec's and pass as they are; OpenRLHF's are translated.
    same = {name: value for name, value in locals().items() if name in EngineSetSpec.model_fields}
    # An engine setting with no parameter of its own here comes as an engine argument.
    named = [name for name in engine_kwargs if name in EngineSetSpec.model_fields]
    same |= {name: engine_kwargs.pop(name) for name in named}
    translated = {
        "max_len": resolve_max_len(max_len, max_model_len),
        "engine_kwargs": with_logprobs_mode(engine_kwargs, logprobs_mode),
        "sleep": vllm_enable_sleep,
        "placement": Placement.of(shared_pg, colocate_trainer),
    }
    return start_engine_set(EngineSetSpec(**(same | translated)))


def check_unsupported(agent_func_path: Any, remote_rm_url: Any, max_images_per_prompt: Any) -> None:
    """OpenRLHF features the engines do not have."""
    # OpenRLHF's engines hand remote_rm_url to their single-turn executor only.
    if remote_rm_url is not None and agent_func_path is None:
        raise EngineSpecError(
            f"remote_rm_url={remote_rm_url!r} is not supported: engines compute no "
            "rewards; score the outputs in your trainer"
        )
    if max_images_per_prompt:
        raise EngineSpecError(
            f"max_images_per_prompt={max_images_per_prompt!r} is not supported: "
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


def with_logprobs_mode(engine_kwargs: dict[str, Any], mode: str | None) -> dict[str, Any]:
    """The engine arguments with OpenRLHF's `logprobs_mode` among them."""
    if not mode:
        return engine_kwargs
    if engine_kwargs.get("logprobs_mode", mode) != mode:
        raise EngineSpecError(f"logprobs_mode={mode!r} given twice, differently")
    # As OpenRLHF: the sampled token's logprob only.
    return {"max_logprobs": 1} | engine_kwargs | {"logprobs_mode": mode}


# Deadline of `batch_vllm_engine_call`: sleep and wake_up of a 70B model move
# its weights (140 GB in bf16) between GPU and host memory, and a pause in mode
# "wait" waits for the longest generation in flight.
BATCH_CALL_TIMEOUT_S = 600.0


def batch_vllm_engine_call(
    engines: list[Any],
    method_name: str,
    *args: Any,
    rank_0_only: bool = True,
    timeout_s: float = BATCH_CALL_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any] | None:
    """OpenRLHF's helper (openrlhf/trainer/ray/vllm_engine.py, v0.11.2): call
    `method_name` on every engine and return the results in order; with
    `rank_0_only`, a non-zero rank of an initialised torch.distributed group
    calls nothing and gets None. Raises the first engine's error; all calls
    share one deadline, `timeout_s`."""
    torch = sys.modules.get("torch")  # not imported here: flows must not need torch
    if rank_0_only and torch is not None and torch.distributed.is_initialized():
        if torch.distributed.get_rank() != 0:
            return None
    return raise_first_error(
        call_engines(engines, method_name, *args, timeout_s=timeout_s, **kwargs)
    )
