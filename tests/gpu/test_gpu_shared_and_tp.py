"""Placement on real GPUs: two engines sharing one GPU through a caller's
placement group (fractional GPUs, as when colocated with a trainer), and one
tensor-parallel engine spread over two GPUs by vLLM's Ray executor."""

from __future__ import annotations

import pytest
from gpu_helpers import (
    MODEL_SHAPE,
    assert_logprob_parity,
    vllm_engine,
    wait_gpus_released,
    wait_ready,
)

from engines import SamplingParams, create_vllm_engines, destroy_engines
from engines.tiny_model import build_tiny_model
from engines.weight_sync import SyncConfig, sync_from_checkpoint

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
PROMPT = [40, 41, 42, 43, 44, 45]
TIMEOUT_S = 120


def test_two_engines_share_one_gpu_through_shared_pg(
    ray_gpu, gpu_model, hf_reference, gpu_baseline
):
    ray = ray_gpu
    from ray.util.placement_group import placement_group, remove_placement_group

    # Two half-GPU bundles: Ray packs fractional bundles onto one device.
    pg = placement_group([{"GPU": 0.5, "CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    engines = create_vllm_engines(
        num_engines=2,
        pretrain=gpu_model,
        max_len=2048,
        gpu_memory_utilization=0.2,
        tensor_parallel_size=1,
        backend="vllm",
        name_prefix="gpu-shared",
        shared_pg=pg,
        enforce_eager=True,
    )
    try:
        wait_ready(engines, "2 engines on one GPU (shared_pg)")
        healths = ray.get([e.health.remote() for e in engines], timeout=TIMEOUT_S)
        uuids = {h["gpus"][0]["gpu_uuid"] for h in healths}
        print(f"shared_pg engines on {uuids}")
        assert len(uuids) == 1, "the engines of one shared bundle pair sit on different GPUs"
        results = ray.get([e.generate.remote(PROMPT, GREEDY) for e in engines], timeout=TIMEOUT_S)
        a, b = (r.outputs[0] for r in results)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 32
        assert_logprob_parity(hf_reference, PROMPT, a)
    finally:
        destroy_engines(engines)
        remove_placement_group(pg)
        wait_gpus_released(gpu_baseline)


def test_tensor_parallel_engine_through_vllm_ray_executor(
    ray_gpu, gpu_model, gpu_count, hf_reference, gpu_baseline, tmp_path
):
    if gpu_count < 2:
        pytest.skip("TP=2 needs two GPUs of one host")
    ray = ray_gpu
    engines = vllm_engine(gpu_model, "gpu-tp2", tensor_parallel_size=2)
    try:
        wait_ready(engines, "1 TP=2 engine (vLLM Ray executor)")
        health = ray.get(engines[0].health.remote(), timeout=TIMEOUT_S)
        print(f"TP=2 workers: {health['gpus']}")
        assert [g["rank"] for g in health["gpus"]] == [0, 1]
        assert len({g["gpu_uuid"] for g in health["gpus"]}) == 2
        output = ray.get(engines[0].generate.remote(PROMPT, GREEDY), timeout=TIMEOUT_S)
        assert len(output.outputs[0].token_ids) == 32
        assert_logprob_parity(hf_reference, PROMPT, output.outputs[0])
        assert ray.get(engines[0].reset_prefix_cache.remote(), timeout=TIMEOUT_S) is True

        # A weight sync into both TP ranks: each worker loads its shard of new
        # weights (a checkpoint: both GPUs are the engine's). The first sync
        # records the copies, TP narrowing included; the second replays them.
        for version in (1, 2):
            path = build_tiny_model(tmp_path / f"v{version}", seed=version, **MODEL_SHAPE)
            report = sync_from_checkpoint(engines, str(path), version, SyncConfig(timeout_s=120))
            print(f"TP=2 sync v{version}: {report.as_dict()}")
            assert report.verified
        plans = ray.get(engines[0].collective_rpc.remote("copy_plan_status"), timeout=TIMEOUT_S)
        print(f"TP=2 copy plans: {plans}")
        assert all(plan["copies"] > 0 and plan["refused"] is None for plan in plans), plans
        import torch
        from transformers import AutoModelForCausalLM

        synced = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        synced = synced.to(hf_reference.device).eval()
        output = ray.get(engines[0].generate.remote(PROMPT, GREEDY), timeout=TIMEOUT_S)
        assert output.weight_version == 2
        assert_logprob_parity(synced, PROMPT, output.outputs[0])
    finally:
        destroy_engines(engines)
        wait_gpus_released(gpu_baseline)
