"""OpenRLHF v0.11.2's call sites, mirrored line by line where its modules
import vLLM or DeepSpeed at the top: how its trainer creates engines
(cli/train_ppo_ray.py), builds a rollout's SamplingParams and asks an engine
for an agent's responses (trainer/ppo_utils/samples_generator.py,
`_dispatch_prompts_to_vllm`), and an agent file as its examples write one.
Shared by the CPU (tests/engines/) and GPU (tests/gpu/) OpenRLHF tests."""

from __future__ import annotations

from typing import Any

PROMPT = "The quick brown fox"
FEEDBACK = " Again?"
# An agent file as OpenRLHF's examples write one (examples/python/agent_func.py):
# an AgentInstanceBase and an AgentExecutor over it. It is never done: every
# rollout ends when the token budget runs out, mid-conversation.
AGENT = f"""
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        return {{
            "rewards": torch.tensor(0.5),
            "scores": torch.tensor(float(self.step_idx)),
            "environment_feedback": {FEEDBACK!r},
            "done": False,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {{"steps": torch.tensor(self.step_idx)}},
        }}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def create_call(pretrain: str, **changes: Any) -> dict[str, Any]:
    """cli/train_ppo_ray.py's create_vllm_engines call, by keyword (our
    positional order is the seed's), with `changes`; its argument check sets
    `remote_rm_url = "agent"` beside an agent_func_path."""
    call = {
        "num_engines": 1,
        "tensor_parallel_size": 1,
        "pretrain": pretrain,
        "seed": 42,
        "full_determinism": False,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "max_model_len": 256,
        "shared_pg": None,
        "gpu_memory_utilization": None,
        "vllm_enable_sleep": False,
        "logprobs_mode": None,
        "agent_func_path": None,
        "remote_rm_url": None,
        "max_images_per_prompt": 0,
    } | changes
    if call["agent_func_path"] is not None:
        call["remote_rm_url"] = "agent"
    return call


def dispatch_sampling_params(sampling_params_class: type, generate_kwargs: dict) -> Any:
    """The SamplingParams `_dispatch_prompts_to_vllm` builds from the
    trainer's generate kwargs (ours or vLLM's class): max_new_tokens unset,
    the budget is each prompt's max_len."""
    return sampling_params_class(
        temperature=generate_kwargs.get("temperature", 1.0),
        top_p=generate_kwargs.get("top_p", 1.0),
        top_k=generate_kwargs.get("top_k", -1),
        max_tokens=generate_kwargs.get("max_new_tokens"),  # None = dynamic per-prompt
        min_tokens=generate_kwargs.get("min_new_tokens", 1),
        skip_special_tokens=generate_kwargs.get("skip_special_tokens", False),
        logprobs=1,
    )


def generate_responses(
    engine: Any, sampling_params: Any, tokenizer: Any, generate_kwargs: dict, label: Any
) -> Any:
    """`_dispatch_prompts_to_vllm`'s call for PROMPT: its responses' ref."""
    return engine.generate_responses.remote(
        prompt=PROMPT,
        label=label,
        sampling_params=sampling_params,
        max_length=generate_kwargs.get("max_len", 2048),
        hf_tokenizer=tokenizer,
        num_samples=generate_kwargs.get("n_samples_per_prompt", 1),
        images=None,
    )
