"""Weight sync into real vLLM engines: CUDA IPC from a trainer on the engine's
own GPU (engine asleep during training, woken weights-first), and NCCL
bucketed broadcast from a trainer on another GPU. After each sync the engine's
logprobs match the trainer's (bf16 tolerance, gpu_helpers.py) and differ from
before: the weights really moved. NCCL syncs are verified by checksum; CUDA
IPC syncs copy straight from the trainer's memory (nothing in transit to
verify), and the third of them reuses the handles the engine kept."""

from __future__ import annotations

import pytest
from gpu_helpers import (
    PARITY_SEQUENCES,
    SYNCED_MAX_ABS,
    SYNCED_MEAN_ABS,
    colocated,
    engine_prompt_logprobs,
    logprob_distance,
    vllm_engine,
    wait_gpus_released,
    wait_ready,
)
from gpu_trainer import start_bf16_policy

from engines import SamplingParams, destroy_engines
from engines.weight_sync import SyncReport

pytestmark = pytest.mark.gpu

TIMEOUT_S = 180
# A sync that loaded nothing leaves the logprobs where they were; noise of std
# 0.02 on weights of std 0.02 moves them by far more than the parity bound.
MOVED_MIN = 0.5


def assert_matches_trainer(ray, engine, policy, what: str) -> list[list[float]]:
    ours = engine_prompt_logprobs(engine, TIMEOUT_S)
    trainer = ray.get(policy.sequence_logprobs.remote(PARITY_SEQUENCES), timeout=TIMEOUT_S)
    worst, mean = logprob_distance(ours, trainer)
    print(f"{what}: engine vs trainer logprobs max |diff| {worst:.4f}, mean {mean:.4f}")
    assert worst < SYNCED_MAX_ABS and mean < SYNCED_MEAN_ABS, (worst, mean)
    return ours


def sync_and_check(ray, engine, policy, before, seed: int, scale: float = 0.02) -> SyncReport:
    version = ray.get(policy.perturb.remote(scale, seed), timeout=TIMEOUT_S)
    report = ray.get(policy.sync_weights.remote(), timeout=TIMEOUT_S)
    print(f"sync v{version}: {report}")
    assert report.version == version and not report.skipped
    assert report.verified == (report.transport == "broadcast")
    # The probe ran on vLLM (a prompt-logprobs request) before anything computed on
    # the new weights was released; the sync returned with its verdict.
    assert report.probe.status == "passed", report.probe
    health = ray.get(engine.health.remote(), timeout=TIMEOUT_S)
    assert health["weight_version"] == version and not health["stale"]
    after = assert_matches_trainer(ray, engine, policy, f"after sync v{version}")
    # Loads after the first replay the copies recorded from vLLM's own
    # load_weights: the parity above is also the check that they are right.
    (plan,) = ray.get(engine.collective_rpc.remote("copy_plan_status"), timeout=TIMEOUT_S)
    print(f"copy plan after sync v{version}: {plan}")
    assert plan["refused"] is None and plan["copies"] > 0
    moved, _ = logprob_distance(before, after)
    print(f"sync v{version} moved the engine's logprobs by up to {moved:.3f}")
    assert moved > MOVED_MIN, f"the engine's logprobs barely moved ({moved:.4f})"
    out = ray.get(engine.generate.remote([5, 6, 7], SamplingParams(max_tokens=4)), timeout=60)
    assert out.weight_version == version
    return report


def test_cuda_ipc_sync_into_a_sleeping_colocated_engine(ray_gpu, gpu_model, gpu_baseline):
    ray = ray_gpu
    # One GPU bundle shared by the engine and the trainer (OpenRLHF's colocation).
    with colocated(
        gpu_model,
        gpu_baseline,
        start_bf16_policy,
        "gpu-ipc",
        "1 engine colocated with the trainer",
        max_len=2048,
        enable_sleep_mode=True,
    ) as (engines, policy):
        engine = engines[0]
        gpu = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["gpus"][0]["gpu_uuid"]
        assert ray.get(policy.gpu_uuid.remote(), timeout=TIMEOUT_S) == gpu
        before = assert_matches_trainer(ray, engine, policy, "before any sync")
        ray.get(policy.init_weight_sync.remote(engines, transport="cuda_ipc"), timeout=TIMEOUT_S)
        # The third perturbation is smaller: bf16 error grows with the weights.
        for seed, scale in ((1, 0.02), (2, 0.02), (3, 0.01)):
            # Training time: the engine sleeps; the sync wakes its weights
            # first, loads the new ones through CUDA IPC, then the KV cache.
            ray.get(engine.sleep.remote(level=1), timeout=TIMEOUT_S)
            report = sync_and_check(ray, engine, policy, before, seed, scale)
            assert report.transport == "cuda_ipc"
            # The trainer's parameters stay put: from the second sync on the
            # engine keeps them mapped and its copies run as one CUDA graph
            # (captured in sync 2, replayed in sync 3; the parity above checks it).
            (plan,) = ray.get(engine.collective_rpc.remote("copy_plan_status"), timeout=TIMEOUT_S)
            assert plan["graph"] == (seed >= 2) and plan["graph_error"] is None, plan
            # Kept tensors: the engine answered with its copies queued, and the
            # trainer waited on its CUDA event (the parity above reads the result).
            assert ("copies" in report.phases) == (seed >= 2), report.phases
            assert ray.get(engine.health.remote(), timeout=TIMEOUT_S)["sleeping"] == []
            before = engine_prompt_logprobs(engine, TIMEOUT_S)


def test_nccl_broadcast_from_a_trainer_on_another_gpu(ray_gpu, gpu_model, gpu_count, gpu_baseline):
    if gpu_count < 2:
        pytest.skip("NCCL between trainer and engine needs two GPUs (NCCL refuses one)")
    ray = ray_gpu
    engines = vllm_engine(gpu_model, "gpu-nccl")
    policy = start_bf16_policy(gpu_model, num_cpus=1, num_gpus=1)
    engine = engines[0]
    try:
        wait_ready(engines, "1 engine, trainer on another GPU")
        gpu = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["gpus"][0]["gpu_uuid"]
        assert ray.get(policy.gpu_uuid.remote(), timeout=TIMEOUT_S) != gpu
        before = assert_matches_trainer(ray, engine, policy, "before any sync")
        info = ray.get(
            policy.init_weight_sync.remote(
                engines,
                transport="broadcast",
                backend="nccl",
                # Small buckets, so the model travels in several (bucketing tested).
                sync_config={"bucket_bytes": 64 << 20, "timeout_s": 120.0},
            ),
            timeout=TIMEOUT_S,
        )
        assert info["backend"] == "nccl" and info["world_size"] == 2
        for seed in (1, 2):
            report = sync_and_check(ray, engine, policy, before, seed)
            assert report.transport == "broadcast" and report.buckets > 1
            before = engine_prompt_logprobs(engine, TIMEOUT_S)
    finally:
        ray.kill(policy)
        destroy_engines(engines)
        wait_gpus_released(gpu_baseline)
