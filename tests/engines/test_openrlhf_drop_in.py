"""Our engines driven the way OpenRLHF v0.11.2 drives its own, with its own
code where it imports without DeepSpeed or vLLM (`openrlhf.utils.agent`'s
executors, installed by `make venv` with `--no-deps`), and its call sites
mirrored line by line where its module needs vLLM
(openrlhf/trainer/ray/vllm_engine.py imports vllm at the top)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch
from openrlhf_calls import PROMPT, create_call
from waiting import SETUP_TIMEOUT_S

from engines import SamplingParams, batch_vllm_engine_call, create_vllm_engines, destroy_engines

agent = pytest.importorskip("openrlhf.utils.agent", reason="pip install --no-deps openrlhf==0.11.2")

REWARD = """
import torch

def reward_func(queries, prompts, labels):
    # OpenRLHF's custom reward: one score per query.
    return {"rewards": torch.tensor([float(len(q) > len(p)) for q, p in zip(queries, prompts)]),
            "scores": torch.tensor([1.0] * len(queries)), "extra_logs": {"label": labels}}
"""


class EngineActor:
    """What OpenRLHF's executors get as `llm_engine`: its RolloutRayActor
    passes itself (vllm_engine.py, generate_responses: `llm_engine=self`) and
    they `await llm_engine.generate(prompt_token_ids, sampling_params,
    multi_modal_data=...)`. Here the same call goes to our engine actor."""

    def __init__(self, handle):
        self.handle = handle

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        return await self.handle.generate.remote(
            prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data
        )


class TwoTurns(agent.AgentInstanceBase):
    def __init__(self):
        self.turns = 0

    async def step(self, state_dict, **kwargs):
        self.turns += 1
        return {
            "rewards": torch.tensor(1.0),
            "scores": torch.tensor(float(self.turns)),
            "environment_feedback": " And then?",
            "done": self.turns == 2,
        }


@pytest.fixture(scope="module")
def openrlhf_engines(ray_local_module, tiny_model):
    from transformers import AutoTokenizer

    engines = create_vllm_engines(**create_call(tiny_model, vllm_enable_sleep=True))
    health = ray.get(engines[0].health.remote(), timeout=SETUP_TIMEOUT_S)
    assert health["sleeping"] == ["kv_cache", "weights"]  # asleep once created, as OpenRLHF's
    # ppo_utils/samples_generator.py:66-67
    batch_vllm_engine_call(engines, "wake_up")
    yield engines, AutoTokenizer.from_pretrained(tiny_model)
    destroy_engines(engines)


def test_evaluation_engines_beside_rollout_engines(openrlhf_engines, tiny_model):
    """A second call in the same namespace, no name_prefix (OpenRLHF's
    evaluation engines); with logprobs_mode as its correction mode sets it."""
    rollout, _ = openrlhf_engines
    evaluation = create_vllm_engines(**create_call(tiny_model, logprobs_mode="processed_logprobs"))
    try:
        assert evaluation.name_prefix != rollout.name_prefix
        params = SamplingParams(temperature=0.7, top_k=5, max_tokens=6, logprobs=1, seed=3)
        output = ray.get(evaluation[0].generate.remote([5, 6, 7], params), timeout=120)
        sample = output.outputs[0]
        # processed_logprobs: of the distribution sampled from (its top 5).
        for position, token in zip(sample.logprobs, sample.token_ids, strict=True):
            assert position[token].logprob > -1e9 and position[token].rank <= 5
        with pytest.raises(Exception, match="max_logprobs=1"):
            ray.get(evaluation[0].generate.remote([5], SamplingParams(logprobs=2)), timeout=60)
    finally:
        destroy_engines(evaluation)


def test_single_turn_executor_with_a_reward_func(openrlhf_engines, tmp_path):
    engines, tokenizer = openrlhf_engines
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=str(reward))
    params = SamplingParams(temperature=1.0, max_tokens=None, logprobs=0, seed=5)
    output = asyncio.run(
        executor.execute(
            prompt=PROMPT,
            label="a label",
            sampling_params=params,
            max_length=40,
            hf_tokenizer=tokenizer,
            llm_engine=EngineActor(engines[0]),
        )
    )
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    (start, end) = output["action_ranges"][0]
    assert output["observation_tokens"][:start] == prompt_ids
    assert end == len(output["observation_tokens"]) <= 40
    logprobs = output["rollout_log_probs"][start:]
    assert len(logprobs) == end - start and all(lp < 0.0 for lp in logprobs)
    assert output["reward"] is not None and output["extra_logs"] == {"label": ["a label"]}
    assert params.max_tokens is None  # the executor changed a deep copy


def test_multi_turn_executor_sets_max_tokens_each_turn(openrlhf_engines):
    engines, tokenizer = openrlhf_engines
    executor = agent.MultiTurnAgentExecutor(TwoTurns)
    # Every token stops a turn: two turns of one token each, whatever the model.
    params = SamplingParams(temperature=0.0, stop_token_ids=list(range(len(tokenizer))), logprobs=0)
    output = asyncio.run(
        executor.execute(
            prompt=PROMPT,
            label=None,
            sampling_params=params,
            max_length=48,
            hf_tokenizer=tokenizer,
            llm_engine=EngineActor(engines[0]),
        )
    )
    assert len(output["action_ranges"]) == 2 and output["scores"].item() == 2.0
    assert len(output["rollout_log_probs"]) == len(output["observation_tokens"])
    # The last turn was given what was left of max_length.
    assert params.max_tokens == 48 - output["action_ranges"][1][0]


def test_async_trainer_pauses_generation_in_flight(openrlhf_engines):
    """ppo_trainer_async.py:255-265 (broadcast_to_vllm with partial rollouts):
    pause_generation, update the weights, resume_generation; a rollout in
    flight is frozen meanwhile and finishes after the resume."""
    engines, _ = openrlhf_engines
    long = SamplingParams(n=8, max_tokens=250, ignore_eos=True, seed=1)
    in_flight = engines[0].generate.remote([5, 6, 7], long)
    deadline = time.monotonic() + 60
    while not ray.get(engines[0].get_num_unfinished_requests.remote(), timeout=30):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    started = time.monotonic()
    batch_vllm_engine_call(engines, "pause_generation")
    pause_s = time.monotonic() - started
    try:
        assert pause_s < 1.0
        assert ray.get(engines[0].get_num_unfinished_requests.remote(), timeout=30) == 1
        ready, _ = ray.wait([in_flight], timeout=0.5)
        assert not ready, "a request ran while the engine was paused"
    finally:
        batch_vllm_engine_call(engines, "resume_generation")
    output = ray.get(in_flight, timeout=120)
    assert all(len(sample.token_ids) == 250 for sample in output.outputs)
    assert output.weight_versions == [output.weight_version]  # no sync happened
