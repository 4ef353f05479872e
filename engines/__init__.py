"""Rollout engines as Ray actors: vLLM on GPUs, a transformers backend on CPUs,
behind one actor API (see `engines.base.RolloutEngine`)."""

from engines.client import EngineCallResult, call_engines
from engines.errors import (
    BackendUnavailableError,
    EngineDeadError,
    EngineFailure,
    EngineSleepingError,
    EngineSpecError,
    EngineTimeoutError,
    PromptTooLongError,
    RequestError,
)
from engines.outputs import CompletionOutput, RequestOutput
from engines.sampling import SamplingParams
from engines.vllm_engine import (
    EngineSet,
    batch_vllm_engine_call,
    create_vllm_engines,
    destroy_engines,
    replace_engine,
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
    "create_vllm_engines",
    "destroy_engines",
    "replace_engine",
]
