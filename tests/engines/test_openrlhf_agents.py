"""OpenRLHF's `agent_func_path` on our engines, run as OpenRLHF v0.11.2 runs
it: its own `MultiTurnAgentExecutor` / `SingleTurnAgentExecutor` inside the
engine actor, driven with its trainer's call shape
(openrlhf/trainer/ppo_utils/samples_generator.py, `_dispatch_prompts_to_vllm`
and `_process_response_into_experience`, mirrored line by line: that module
imports vLLM)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import ray
import torch
from openrlhf_calls import (
    AGENT,
    FEEDBACK,
    PROMPT,
    create_call,
    dispatch_sampling_params,
    generate_responses,
)
from transformers import AutoConfig, AutoTokenizer
from waiting import SETUP_TIMEOUT_S

from engines import EngineSpecError, SamplingParams, create_vllm_engines, destroy_engines
from engines.openrlhf.agents import run_openrlhf_agent
from engines.trajectory import NOT_SAMPLED
from engines.weight_sync import SyncConfig, sync_from_checkpoint

pytest.importorskip("openrlhf.utils.agent", reason="pip install --no-deps openrlhf==0.11.2")


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("agent") / "agent_func.py"
    path.write_text(AGENT)
    return str(path)


@pytest.fixture(scope="module")
def agent_engines(ray_local_module, tiny_model, agent_file):
    engines = create_vllm_engines(**create_call(tiny_model, agent_func_path=agent_file))
    ray.get(engines[0].ready.remote(), timeout=SETUP_TIMEOUT_S)
    yield engines, AutoTokenizer.from_pretrained(tiny_model)
    destroy_engines(engines)


def test_trainer_drives_agent_func_path(agent_engines):
    """samples_generator.py's dispatch: a SamplingParams as it builds one
    (max_new_tokens unset: the budget is max_len), `generate_responses` per
    prompt; each response becomes an experience as it builds one."""
    engines, tokenizer = agent_engines
    generate_kwargs = {"temperature": 1.0, "max_len": 64, "n_samples_per_prompt": 2}
    sampling_params = dispatch_sampling_params(SamplingParams, generate_kwargs)
    truncate_length = generate_kwargs["max_len"]
    n_samples = generate_kwargs["n_samples_per_prompt"]
    pending_counts = ray.get([e.get_num_unfinished_requests.remote() for e in engines], timeout=60)
    assert pending_counts == [0]
    ref = generate_responses(engines[0], sampling_params, tokenizer, generate_kwargs, "a label")
    responses = ray.get(ref, timeout=300)
    assert len(responses) == n_samples
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    feedback_ids = tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    for response in responses:
        observation, ranges = response["observation_tokens"], response["action_ranges"]
        assert observation[: len(prompt_ids)] == prompt_ids and ranges[0][0] == len(prompt_ids)
        # Never done: the budget ran out, after each turn's feedback.
        assert len(observation) >= truncate_length
        for (_, end), (following, _) in zip(ranges, ranges[1:], strict=False):
            assert observation[end:following] == feedback_ids
        assert response["reward"] == 0.5 * len(ranges)
        assert response["extra_logs"]["steps"].item() == len(ranges)
        # _process_response_into_experience's action mask and logprobs.
        action_mask = torch.zeros(len(observation), dtype=torch.long)
        for start, end in ranges:
            action_mask[start:end] = 1
        logprobs = torch.tensor(response["rollout_log_probs"])
        assert len(logprobs) == len(observation)
        assert (logprobs[action_mask == 1] < 0).all() and (logprobs[action_mask == 0] == 0).all()


def test_multi_turn_budget_runs_out_mid_conversation(agent_engines, agent_file):
    """Turns of one token each (every token stops a turn) until the token
    budget runs out: the executor sets max_tokens to what is left, <= 0 at
    the end, as vLLM's SamplingParams lets it; the rollout is a trajectory."""
    engines, tokenizer = agent_engines
    vocab = AutoConfig.from_pretrained(
        tokenizer.name_or_path
    ).vocab_size  # padded past the tokenizer
    params = SamplingParams(temperature=0.0, stop_token_ids=list(range(vocab)), logprobs=0)
    rollout = asyncio.run(
        run_openrlhf_agent(
            engines[0],
            prompt=PROMPT,
            label=None,
            sampling_params=params,
            max_length=48,
            agent_func_path=agent_file,
            tokenizer=tokenizer,
        )
    )
    sample = rollout.sample
    feedback = tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    turns = (48 - len(sample.prompt_token_ids) + len(feedback)) // (1 + len(feedback))
    assert sample.prompt_token_ids == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert sample.loss_mask == ([1] + [0] * len(feedback)) * turns
    assert [t.role for t in sample.turns] == ["assistant", "environment"] * turns
    assert {t.engine for t in sample.turns if t.role == "assistant"} == {engines.names[0]}
    pairs = list(zip(sample.token_versions, sample.logprobs, sample.loss_mask, strict=True))
    assert all(v == (0 if m else NOT_SAMPLED) for v, _, m in pairs)
    assert all(lp <= 0 if m else lp == 0 for _, lp, m in pairs)
    assert rollout.reward == 0.5 * turns
    assert rollout.info["scores"] == float(turns) and rollout.info["extra_logs"] == {"steps": turns}


def test_single_turn_executor_without_agent_func_path(agent_engines):
    engines, tokenizer = agent_engines
    params = SamplingParams(max_tokens=None, logprobs=0, seed=3)
    rollout = asyncio.run(
        run_openrlhf_agent(
            engines[0],
            prompt=PROMPT,
            label="x",
            sampling_params=params,
            max_length=40,
            agent_func_path=None,
            tokenizer=tokenizer,
        )
    )
    sample = rollout.sample
    assert len(sample.prompt_token_ids) + len(sample.response_token_ids) <= 40
    assert sample.loss_mask == [1] * len(sample.response_token_ids) and len(sample.turns) == 1
    assert rollout.reward is None and rollout.info["label"] == "x"  # no reward model: none


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/nonexistent/agent.py", "agent_func_path='/nonexistent/agent.py' does not exist"),
        ("agent.txt", r"agent_func_path='agent.txt' must be a Python file \(.py\)"),
        (
            "no_executor.py",
            "must define a class AgentExecutor that inherits "
            "openrlhf.utils.agent.AgentExecutorBase",
        ),
        ("broken.py", r"agent_func_path='.*broken.py' failed to load: NameError"),
    ],
)
def test_bad_agent_func_path_is_refused_before_engines_exist(
    ray_local, tiny_model, tmp_path, monkeypatch, path, message
):
    (tmp_path / "no_executor.py").write_text("AgentExecutor = object\n")
    (tmp_path / "broken.py").write_text("undefined_name\n")
    monkeypatch.chdir(tmp_path)
    before = ray.util.list_named_actors(all_namespaces=True)
    with pytest.raises(EngineSpecError, match=message):
        create_vllm_engines(**create_call(tiny_model, agent_func_path=path))
    assert ray.util.list_named_actors(all_namespaces=True) == before


def test_without_openrlhf_agent_func_path_names_the_package(
    ray_local, tiny_model, agent_file, monkeypatch
):
    monkeypatch.setitem(sys.modules, "openrlhf", None)  # not importable, as when not installed
    with pytest.raises(EngineSpecError, match="pip install --no-deps openrlhf==0.11.2"):
        create_vllm_engines(**create_call(tiny_model, agent_func_path=agent_file))


def test_sampled_tokens_carry_the_version_that_sampled_them(agent_engines, agent_file, tiny_model):
    engines, tokenizer = agent_engines
    sync_from_checkpoint(list(engines), tiny_model, version=7, config=SyncConfig(timeout_s=60))
    rollout = asyncio.run(
        run_openrlhf_agent(
            engines[0],
            prompt=PROMPT,
            label=None,
            sampling_params=SamplingParams(max_tokens=4, seed=1),
            max_length=40,
            agent_func_path=agent_file,
            tokenizer=tokenizer,
        )
    )
    pairs = zip(rollout.sample.token_versions, rollout.sample.loss_mask, strict=True)
    assert {version for version, sampled in pairs if sampled} == {7}
    assert rollout.sample.logprobs == [0.0] * len(rollout.sample.loss_mask)  # none asked
