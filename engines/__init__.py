"""Rollout engines as Ray actors: vLLM on GPUs, a transformers backend on CPUs,
behind one actor API (see `engines.base.RolloutEngine`).

Exported here: what `tasks/`, `agents/` and `training/` use of the engines:
an engine set's spec, start and repair (`engines.lifecycle`), calls to the
engines and their errors, sampling and outputs, the engines' load, the
trajectory an agent session records, the OpenAI server an actor runs, and
OpenRLHF's engine-set API (`engines.openrlhf`). Weight sync is
`engines.weight_sync`'s."""

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
from engines.lifecycle import (  # noqa: E402
    EngineSet,
    EngineSetSpec,
    Placement,
    PlacementMode,
    adopt_prepared,
    check_cluster_fits,
    destroy_engines,
    replace_engine,
    resolve_backend,
    restart_engine,
    start_engine_set,
    swap_in_spare,
)
from engines.load import EngineLoad  # noqa: E402
from engines.openrlhf.vllm_engine import batch_vllm_engine_call, create_vllm_engines  # noqa: E402
from engines.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from engines.sampling import SamplingParams  # noqa: E402
from engines.serving import OpenAIServer  # noqa: E402
from engines.trajectory import NOT_SAMPLED, TrajectorySample, TurnSpan  # noqa: E402

__all__ = [
    "BackendUnavailableError",
    "CompletionOutput",
    "EngineCallResult",
    "EngineDeadError",
    "EngineFailure",
    "EngineLoad",
    "EngineSet",
    "EngineSetSpec",
    "EngineSleepingError",
    "EngineSpecError",
    "EngineStaleError",
    "EngineTimeoutError",
    "Logprob",
    "NOT_SAMPLED",
    "OpenAIServer",
    "Placement",
    "PlacementMode",
    "PromptTooLongError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "TrajectorySample",
    "TurnSpan",
    "adopt_prepared",
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
