"""Partial rollouts on a vLLM engine (one GPU): the abort that ends an
iteration answers the long samples with their tokens and logprobs so far,
and after a weight sync the resumed samples keep those tokens and continue
under the new version, each token stamped with the version that sampled it."""

from __future__ import annotations

import copy

import pytest
from gpu_helpers import vllm_engine, wait_gpus_released, wait_ready

from engines import SamplingParams, destroy_engines
from tasks.partial.runner import SegmentRunner
from tasks.partial.segments import GroupState, SampleState
from tasks.run.pool import EnginePool

pytestmark = pytest.mark.gpu

LONG, SHORT = 1536, 16
SAMPLING = SamplingParams(n=2, temperature=1.0, ignore_eos=True, logprobs=0, max_tokens=LONG)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def pool(ray_gpu, gpu_model, gpu_baseline):
    engines = vllm_engine(gpu_model, "gpu-partial")
    try:
        wait_ready(engines, "one engine")
        yield EnginePool(engines)
    finally:
        destroy_engines(engines)
        wait_gpus_released(gpu_baseline)


def test_aborted_samples_resume_after_a_sync_keeping_their_tokens(ray_gpu, pool, tmp_path):
    from transformers import AutoModelForCausalLM

    from engines.weight_sync.transports import checkpoint

    ray = ray_gpu
    texts = ["a long one", "a short one"]
    long_group, short_group = (
        GroupState(0, slot, slot, 7 + slot, [SampleState(k, budget) for k in range(2)])
        for slot, budget in ((0, LONG), (1, SHORT))
    )
    runner = SegmentRunner(pool, texts, SAMPLING, batch=1, timeout_s=300, abort_timeout_s=60)
    assert runner.run([long_group, short_group]) == [short_group]
    stopped = copy.deepcopy(long_group.samples)
    for sample in stopped:
        made = len(sample.token_ids)
        assert sample.finish_reason == "abort" and 0 < made < LONG, made
        assert len(sample.positions) == made and set(sample.token_versions) == {0}
    model = AutoModelForCausalLM.from_pretrained(pool.engines.configs[0].pretrain)
    scaled = {
        name: tensor * 1.5 if "lm_head" in name or "embed" in name else tensor
        for name, tensor in model.state_dict().items()
    }
    path = checkpoint.save(scaled.items(), tmp_path / "v1", version=1)
    ray.get(pool.engines[0].load_checkpoint.remote(str(path), version=1), timeout=TIMEOUT_S)
    resumed = SegmentRunner(pool, texts, SAMPLING, batch=1, timeout_s=300, abort_timeout_s=60)
    assert resumed.run([long_group]) == [long_group] and resumed.counts.resumed == 2
    for sample, before in zip(long_group.samples, stopped, strict=True):
        k = len(before.token_ids)
        print(f"sample {sample.index}: {k} tokens before the stop, {LONG - k} after")
        assert sample.token_ids[:k] == before.token_ids and len(sample.token_ids) == LONG
        assert sample.token_versions == [0] * k + [1] * (LONG - k)
        assert len(sample.positions) == LONG and sample.finish_reason == "length"
