"""The parts of vLLM the vLLM backend uses, imported on first use, and the
translations between its types and ours.

vLLM is imported in the engine actor only, so the driver creates the actor
without paying vLLM's import (seconds of torch, transformers and vLLM itself,
which sat on the start-up's critical path before the actor even existed), and
CPU code imports this package without vLLM installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from engines.outputs import CompletionOutput, RequestOutput
from engines.sampling import SamplingParams
from engines.vllm import forkserver


@dataclass(frozen=True)
class VLLMApi:
    """The parts of vLLM this backend uses."""

    vllm: Any
    RequestOutputKind: Any
    UsageContext: Any
    freeze_gc_heap: Any
    AsyncLLM: Any
    EngineDeadError: Any


@functools.cache
def vllm_api() -> VLLMApi:
    """vLLM, imported on first use (in the engine actor)."""
    try:
        import vllm
        import vllm.v1.engine.utils as engine_utils
        from vllm.sampling_params import RequestOutputKind
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.gc_utils import freeze_gc_heap
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            f"the vLLM backend needs vLLM ({exc}); install it with: "
            "pip install 'rolloutflow[vllm]', or use backend='hf' (CPU)"
        ) from exc
    # In a Ray actor vLLM overrides every start method but spawn for its engine
    # core (`_maybe_force_spawn`, https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/utils/system_utils.py);
    # fork it from the server `VLLMEngine.__init__` started (engines/vllm/forkserver.py).
    engine_utils.get_mp_context = forkserver.context
    return VLLMApi(
        vllm=vllm,
        RequestOutputKind=RequestOutputKind,
        UsageContext=UsageContext,
        freeze_gc_heap=freeze_gc_heap,
        AsyncLLM=AsyncLLM,
        EngineDeadError=VLLMEngineDeadError,
    )


#: vLLM pads its embedding and LM-head rows to a multiple of this
#: (DEFAULT_VOCAB_PADDING_SIZE in model_executor/layers/vocab_parallel_embedding.py,
#: v0.26.0; tests/gpu/test_gpu_engines.py checks it). Importing that module
#: for it put 20 more vLLM modules (its custom ops among them) on the actor's start.
VOCAB_PADDING = 64


def padded_vocab_rows(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def vllm_sampling_params(value: Any) -> Any:
    """Our SamplingParams (or a dict, None, or a `vllm.SamplingParams` used as
    is) -> vLLM's, asking for the final output only: `generate` returns whole
    completions, so streaming partial outputs would be wasted work."""
    api = vllm_api()
    if isinstance(value, api.vllm.SamplingParams):
        params = value.clone()
        # vLLM checks only at construction; fields assigned since (OpenRLHF's
        # executors set max_tokens per turn) are checked here, as ours are.
        params._verify_args()
    else:
        # Our fields are vLLM's, by name and meaning.
        params = api.vllm.SamplingParams(**SamplingParams.coerce(value).model_dump())
    params.output_kind = api.RequestOutputKind.FINAL_ONLY
    return params


def request_output(final: Any, request_id: str, prompt: list[int], engine: str) -> RequestOutput:
    """vLLM's final RequestOutput as ours; the weight version is stamped by
    the caller."""
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        outputs=[
            CompletionOutput(
                index=completion.index,
                token_ids=list(completion.token_ids),
                text=completion.text,
                finish_reason=completion.finish_reason,
                # vLLM's own Logprob objects, passed through as they are.
                logprobs=completion.logprobs,
                cumulative_logprob=completion.cumulative_logprob,
                stop_reason=completion.stop_reason,
            )
            for completion in sorted(final.outputs, key=lambda c: c.index)
        ],
        weight_version=0,
        engine=engine,
        prompt_logprobs=final.prompt_logprobs,
        num_cached_tokens=final.num_cached_tokens,
    )


def worker_memory(worker: Any) -> dict[str, Any]:
    """Runs inside each GPU worker (sent through `collective_rpc`): which GPU
    it computes on and that GPU's memory as the driver sees it, so sleep mode
    is measured on the device itself, not through an allocator's view."""
    import torch

    device = worker.device
    free, total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device)
    return {
        "rank": int(worker.rank),
        "device": str(device),
        "gpu_name": props.name,
        "gpu_uuid": str(props.uuid),
        "used_bytes": int(total - free),
        "total_bytes": int(total),
    }
