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

from engines import RequestError, create_vllm_engines, destroy_engines
from engines.openrlhf_agents import run_openrlhf_agent

pytestmark = pytest.mark.gpu
pytest.importorskip("openrlhf.utils.agent", reason="pip install --no-deps openrlhf==0.11.2")

TIMEOUT_S = 300
PROMPT = "The quick brown fox"
FEEDBACK = " Again?"
AGENT = f"""
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        return {{"rewards": torch.tensor(0.5), "environment_feedback": {FEEDBACK!r}, "done": False}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_openrlhf_agent_func_path_on_vllm(ray_gpu, gpu_model, tmp_path):
    import ray
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    agent_file = tmp_path / "agent_func.py"
    agent_file.write_text(AGENT)
    # cli/train_ppo_ray.py's call, by keyword.
    engines = create_vllm_engines(
        num_engines=1,
        tensor_parallel_size=1,
        pretrain=gpu_model,
        seed=42,
        full_determinism=False,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=2048,
        shared_pg=None,
        gpu_memory_utilization=0.3,
        vllm_enable_sleep=False,
        logprobs_mode="processed_logprobs",
        agent_func_path=str(agent_file),
        remote_rm_url="agent",
        max_images_per_prompt=0,
        backend="vllm",
    )
    try:
        wait_ready(engines, "1 engine with an agent_func_path")
        tokenizer = AutoTokenizer.from_pretrained(gpu_model)
        # samples_generator.py, _dispatch_prompts_to_vllm.
        generate_kwargs = {"max_len": 256, "n_samples_per_prompt": 4}
        sampling_params = SamplingParams(
            temperature=generate_kwargs.get("temperature", 1.0),
            top_p=generate_kwargs.get("top_p", 1.0),
            top_k=generate_kwargs.get("top_k", -1),
            max_tokens=generate_kwargs.get("max_new_tokens"),  # None = dynamic per-prompt
            min_tokens=generate_kwargs.get("min_new_tokens", 1),
            skip_special_tokens=generate_kwargs.get("skip_special_tokens", False),
            logprobs=1,
        )
        truncate_length = generate_kwargs.get("max_len", 2048)
        responses = ray.get(
            engines[0].generate_responses.remote(
                prompt=PROMPT,
                label=None,
                sampling_params=sampling_params,
                max_length=truncate_length,
                hf_tokenizer=tokenizer,
                num_samples=generate_kwargs.get("n_samples_per_prompt"),
                images=None,
            ),
            timeout=TIMEOUT_S,
        )
        turns = [len(r["action_ranges"]) for r in responses]
        print(f"\n4 agent rollouts to a {truncate_length}-token budget: turns {turns}")
        for response in responses:
            assert len(response["observation_tokens"]) >= truncate_length  # the budget ran out
            assert response["reward"] == 0.5 * len(response["action_ranges"])
            assert len(response["rollout_log_probs"]) == len(response["observation_tokens"])
        # The executor's assignment, sent as a request: refused naming the field.
        sampling_params.max_tokens = -4
        with pytest.raises(RequestError, match="max_tokens must be at least 1, got -4"):
            ray.get(engines[0].generate.remote([7, 8, 9], sampling_params), timeout=TIMEOUT_S)
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
