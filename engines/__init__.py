"""Rollout engines as Ray actors: vLLM on GPUs, a transformers backend on CPUs,
behind one actor API (see `engines.base.RolloutEngine`)."""

import time

# Before any other import: an engine actor's start-up clock begins here
# (`engines.startup`), so its imports count as its own start-up phase.
_imports_started = time.time()

from engines import startup  # noqa: E402

startup.IMPORTS_STARTED = _imports_started

from engines.client import EngineCallResult, call_engines  # noqa: E402
from engines.errors import (  # noqa: E402
    BackendUnavailableError,
    EngineDeadError,
    EngineFailure,
    EngineSleepingError,
    EngineSpecError,
    EngineStaleError,
    EngineTimeoutError,
    PromptTooLongError,
    RequestError,
)
from engines.lifecycle.engine_set import (  # noqa: E402
    EngineSet,
    destroy_engines,
    replace_engine,
    resolve_backend,
    restart_engine,
    start_engine_set,
)
from engines.lifecycle.placement import Placement, PlacementMode, check_cluster_fits  # noqa: E402
from engines.lifecycle.spares import swap_in_spare  # noqa: E402
from engines.lifecycle.spec import EngineSetSpec  # noqa: E402
from engines.openrlhf.vllm_engine import batch_vllm_engine_call, create_vllm_engines  # noqa: E402
from engines.outputs import CompletionOutput, RequestOutput  # noqa: E402
from engines.sampling import SamplingParams  # noqa: E402

__all__ = [
    "BackendUnavailableError",
    "CompletionOutput",
    "EngineCallResult",
    "EngineDeadError",
    "EngineFailure",
    "EngineStaleError",
    "EngineSet",
    "EngineSetSpec",
    "EngineSleepingError",
    "EngineSpecError",
    "EngineTimeoutError",
    "Placement",
    "PlacementMode",
    "PromptTooLongError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "batch_vllm_engine_call",
    "call_engines",
    "check_cluster_fits",
    "create_vllm_engines",
    "destroy_engines",
    "replace_engine",
    "resolve_backend",
    "restart_engine",
    "start_engine_set",
    "swap_in_spare",
]
