"""Constants and helpers of the GPU suite (fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines import EngineSet

# Seconds an engine may take to come up (vLLM start-up is ~50-80 s on an H200).
READY_TIMEOUT_S = 300
# The GPU model: a random Llama of 0.28B parameters (551.7 MB in bf16),
# byte-level vocabulary.
MODEL_SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, dtype="bfloat16", init_std=0.02)
# bf16 tolerance of vLLM's logprobs against transformers' on the same weights:
# the two use different kernels (fused attention, fused RMSNorm, bf16 GEMM
# split-K), so per-token logprobs differ by rounding only; both reduce in fp32.
# Measured on the built weights (H200, 2026-11-29): max 0.022-0.036, mean
# 0.006-0.009 (TP=1, TP=2, two engines on one GPU).
LOGPROB_MAX_ABS = 0.1
LOGPROB_MEAN_ABS = 0.02
# After a sync of perturbed weights the error grows with the logits: after the
# first perturbation (logits ~1.4x larger) max 0.109 / mean 0.023 (H200,
# 2026-11-29), after a third mean 0.044. The bound leaves room for those.
SYNCED_MAX_ABS = 0.2
SYNCED_MEAN_ABS = 0.06
#: Sequences whose prompt logprobs the sync tests compare (engine against trainer).
PARITY_SEQUENCES = [list(range(5, 69)), [7, 99, 3, 250, 18, 64, 64, 12] * 4, list(range(200, 240))]


@dataclass(frozen=True)
class SyncParity:
    """One sync of the weight-format matrix (test_gpu_weight_formats.py):
    max and mean |engine - trainer| over the parity sequences' logprobs after
    it, the mean distance a sync that loaded nothing would have shown (the
    trainer's logprobs before against after its change), and its seconds."""

    max_abs: float
    mean_abs: float
    stale_mean_abs: float
    seconds: float


def engine_prompt_logprobs(engine, timeout_s: float = 180) -> list[list[float]]:
    """The engine's logprob of tokens 1..n-1 of each parity sequence."""
    import ray

    from engines import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = ray.get(engine.generate.remote(PARITY_SEQUENCES, params), timeout=timeout_s)
    return [
        [
            step[t].logprob
            for step, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
        ]
        for o in outputs
    ]


def logprob_distance(ours: list[list[float]], theirs: list[list[float]]) -> tuple[float, float]:
    """(max, mean) |difference| over every token."""
    flat = [
        abs(a - b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)
    ]
    return max(flat), sum(flat) / len(flat)


def reference_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' logprob of each completion token given what precedes it."""
    import torch

    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logprobs[start + t, token]) for t, token in enumerate(completion)]


def assert_logprob_parity(model, prompt: list[int], completion) -> None:
    """vLLM's sampled-token logprobs (a CompletionOutput) against transformers'."""
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    ours = [entry[token].logprob for entry, token in pairs]
    ref = reference_logprobs(model, prompt, list(completion.token_ids))
    diffs = [abs(a - b) for a, b in zip(ours, ref, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"logprob parity: max |diff| {max(diffs):.4f}, mean {mean:.4f} over {len(diffs)} tokens")
    assert max(diffs) < LOGPROB_MAX_ABS and mean < LOGPROB_MEAN_ABS, (max(diffs), mean)


def wait_ready(engines, what: str) -> float:
    """Seconds from now until every engine answers `ready`."""
    import ray

    start = time.monotonic()
    ray.get([engine.ready.remote() for engine in engines], timeout=READY_TIMEOUT_S)
    took = time.monotonic() - start
    print(f"\n{what}: ready after {took:.1f}s")
    return took


def gpu_used_mib() -> list[int]:
    """Memory in use on each GPU, as the driver counts it (all processes)."""
    import subprocess

    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [int(line) for line in out.split()]


def wait_gpus_released(baseline_mib: list[int], slack_mib: int = 2048, timeout_s: float = 60):
    """After destroy_engines: wait until every GPU is back near `baseline_mib`.
    Fails if an engine's processes keep their memory (a leak the next engine
    would start beside); also keeps the next engine's memory profiling clear of
    memory still being released."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = gpu_used_mib()
        if all(u <= b + slack_mib for u, b in zip(used, baseline_mib, strict=True)):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"GPU memory not released {timeout_s:g}s after shutdown: {used} MiB in use, "
                f"baseline {baseline_mib} MiB"
            )
        time.sleep(0.5)


def vllm_engine(model: str, name_prefix: str, **options: Any) -> EngineSet:
    """One vLLM engine of `model` as the suite starts them (2048 tokens, 30%
    of a GPU, no CUDA graphs: it starts in seconds); `options` add to or
    replace those (create_vllm_engines' keywords)."""
    from engines import create_vllm_engines

    options = {"max_len": 2048, "gpu_memory_utilization": 0.3, "enforce_eager": True} | options
    return create_vllm_engines(
        num_engines=1, pretrain=model, backend="vllm", name_prefix=name_prefix, **options
    )


@contextlib.contextmanager
def colocated(
    model: str,
    baseline_mib: list[int],
    start_policy: Callable[..., Any],
    name_prefix: str,
    what: str,
    **engine_options: Any,
) -> Iterator[tuple[EngineSet, Any]]:
    """One `vllm_engine` of `model` (1024 tokens unless `engine_options` say
    otherwise) and the policy `start_policy` starts, sharing one GPU bundle
    (OpenRLHF's colocation); ready on entry. On exit both end, and the GPUs
    are back near `baseline_mib`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from engines import destroy_engines

    pg = placement_group([{"GPU": 1, "CPU": 2}])
    ray.get(pg.ready(), timeout=60)
    engines = vllm_engine(model, name_prefix, shared_pg=pg, **{"max_len": 1024} | engine_options)
    policy = start_policy(
        model,
        num_cpus=0.2,
        num_gpus=0.2,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    )
    try:
        wait_ready(engines, what)
        yield engines, policy
    finally:
        ray.kill(policy)
        destroy_engines(engines)
        remove_placement_group(pg)
        wait_gpus_released(baseline_mib)


def kill_engine_core(engine) -> list[int]:
    """SIGKILL vLLM's engine-core processes of `engine` (the tests run on the
    engine's host), as the kernel's OOM killer or a GPU fault ends them;
    returns their pids."""
    import os
    import signal

    import ray

    pids = ray.get(engine.health.remote(), timeout=60)["engine_core_pids"]
    assert pids, "the engine reports no engine-core process"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def lora_matrix_row(transports, syncs: int, perturb: float, directory) -> dict[str, list]:
    """The weight-format matrix's LoRA row (tests/gpu/gpu_lora.py): one vLLM
    engine with LoRA and its colocated trainer of a rank-16 adapter, and per
    transport `syncs` adapter-only syncs, each measured (`AdapterSync`:
    max_abs, mean_abs, stale_mean_abs, seconds); over "vllm_native" the
    trainer uses vLLM's own client and IPC code. Cleans up (engines, GPU memory)."""
    from gpu_lora import matrix_row

    return matrix_row(transports, syncs, perturb, directory)
