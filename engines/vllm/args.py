"""vLLM's engine arguments for one engine (`engine_args`): the engine's config,
then the caller's engine arguments, and the worker extension that carries
the weight-sync API into vLLM's workers."""

from __future__ import annotations

from typing import Any

from engines.config import EngineConfig
from engines.vllm.api import VLLMApi

WORKER_EXTENSION = "engines.worker_extension.WeightSyncWorkerExtension"


def engine_args(api: VLLMApi, config: EngineConfig) -> Any:
    """vLLM's AsyncEngineArgs for this engine: its config, then the caller's
    engine arguments."""
    kwargs = dict(config.engine_kwargs)
    if config.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=config.max_lora_rank)
        # Room for the adapter served while the next one loads (weight_sync/lora/).
        kwargs.setdefault("max_cpu_loras", kwargs.get("max_loras", 1) + 1)
    # One GPU: the worker lives in the engine-core process ("uni"). More:
    # vLLM's Ray executor places one worker actor per bundle (the bundles
    # come from VLLM_RAY_BUNDLE_INDICES in this actor's runtime_env).
    kwargs.setdefault(
        "distributed_executor_backend", "uni" if config.tensor_parallel_size == 1 else "ray"
    )
    # vLLM logs throughput every few seconds by default; in an engine
    # actor those lines flood the driver's log. Callers may turn it back on.
    kwargs.setdefault("disable_log_stats", True)
    if config.gpu_memory_utilization is not None:  # None: vLLM's default
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.quantization is not None:  # None: as the checkpoint says
        kwargs["quantization"] = config.quantization
    return api.vllm.AsyncEngineArgs(
        model=config.pretrain,
        max_model_len=config.max_len,
        seed=config.seed,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_prefix_caching=config.enable_prefix_caching,
        worker_extension_cls=WORKER_EXTENSION,
        **kwargs,
    )
