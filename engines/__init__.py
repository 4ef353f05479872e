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
    EngineTimeoutError,
    PromptTooLongError,
    RequestError,
)
from engines.outputs import CompletionOutput, RequestOutput  # noqa: E402
from engines.placement import check_cluster_fits  # noqa: E402
from engines.sampling import SamplingParams  # noqa: E402
from engines.vllm_engine import (  # noqa: E402
    EngineSet,
    batch_vllm_engine_call,
    create_vllm_engines,
    destroy_engines,
    replace_engine,
    resolve_backend,
    restart_engine,
    swap_in_spare,
)

__all__ = [
    "BackendUnavailableError",
    "CompletionOutput",
    "EngineCallResult",
    "EngineDeadError",
    "EngineFailure",
    "EngineSet",
    "EngineSleepingError",
    "EngineSpecError",
    "EngineTimeoutError",
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
    "swap_in_spare",
]
