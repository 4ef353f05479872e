"""OpenRLHF v0.11.2's `agent_func_path` on a vLLM engine: the engine created
with OpenRLHF's keywords and an agent file, driven as its trainer drives it
(trainer/ppo_utils/samples_generator.py: a `vllm.SamplingParams` built as
`_dispatch_prompts_to_vllm` builds it, `generate_responses` per prompt). Its
`MultiTurnAgentExecutor` runs in our actor until the token budget runs out
(it assigns max_tokens <= 0 to vLLM's SamplingParams and stops); a request
with such a value is refused naming the field, and the engine serves on.
One GPU; needs OpenRLHF's agent code (`pip install --no-deps
openrlhf==0.11.2`, and aiohttp, which it imports)."""

from __future__ import annotations

import asyncio

import pytest
from gpu_helpers import wait_ready
from openrlhf_calls import (
    AGENT,
    PROMPT,
    create_call,
    dispatch_sampling_params,
    generate_responses,
)

from engines import RequestError, create_vllm_engines, destroy_engines
from engines import SamplingParams as OurSamplingParams
from engines.openrlhf.agents import run_openrlhf_agent

pytestmark = pytest.mark.gpu
pytest.importorskip("openrlhf.utils.agent", reason="pip install --no-deps openrlhf==0.11.2")

TIMEOUT_S = 300


def test_openrlhf_agent_func_path_on_vllm(ray_gpu, gpu_model, tmp_path):
    import ray
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    agent_file = tmp_path / "agent_func.py"
    agent_file.write_text(AGENT)
    engines = create_vllm_engines(
        **create_call(
            gpu_model,
            max_model_len=2048,
            gpu_memory_utilization=0.3,
            logprobs_mode="processed_logprobs",
            agent_func_path=str(agent_file),
            backend="vllm",
        )
    )
    try:
        wait_ready(engines, "1 engine with an agent_func_path")
        tokenizer = AutoTokenizer.from_pretrained(gpu_model)
        generate_kwargs = {"max_len": 256, "n_samples_per_prompt": 4}
        sampling_params = dispatch_sampling_params(SamplingParams, generate_kwargs)
        truncate_length = generate_kwargs["max_len"]
        ref = generate_responses(engines[0], sampling_params, tokenizer, generate_kwargs, None)
        responses = ray.get(ref, timeout=TIMEOUT_S)
        turns = [len(r["action_ranges"]) for r in responses]
        print(f"\n4 agent rollouts to a {truncate_length}-token budget: turns {turns}")
        for response in responses:
            assert len(response["observation_tokens"]) >= truncate_length  # the budget ran out
            assert response["reward"] == 0.5 * len(response["action_ranges"])
            assert len(response["rollout_log_probs"]) == len(response["observation_tokens"])
        # The executor's assignment, sent as a request, refused naming the field:
        # a vLLM SamplingParams checks itself as the actor unpickles it (Ray's
        # RaySystemError, before our code runs); ours is checked by the request.
        sampling_params.max_tokens = -4
        refusal = "max_tokens must be at least 1, got -4"
        with pytest.raises(ray.exceptions.RaySystemError, match=refusal):
            ray.get(engines[0].generate.remote([7, 8, 9], sampling_params), timeout=TIMEOUT_S)
        ours = OurSamplingParams(max_tokens=8)
        ours.max_tokens = -4
        with pytest.raises(RequestError, match=refusal):
            ray.get(engines[0].generate.remote([7, 8, 9], ours), timeout=TIMEOUT_S)
        rollout = asyncio.run(
            run_openrlhf_agent(
                engines[0],
                prompt=PROMPT,
                label=None,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=8, logprobs=0),
                max_length=64,
                agent_func_path=str(agent_file),
                tokenizer=tokenizer,
            )
        )
        sample = rollout.sample
        assert len(sample.prompt_token_ids) + len(sample.response_token_ids) >= 64
        spans = [(t.start, t.stop) for t in sample.turns if t.role == "assistant"]
        assert sum(sample.loss_mask) == sum(stop - start for start, stop in spans)
        pairs = zip(sample.token_versions, sample.loss_mask, strict=True)
        assert {v for v, m in pairs if m} == {0}
    finally:
        destroy_engines(engines)
