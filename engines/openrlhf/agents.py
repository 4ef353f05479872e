"""OpenRLHF's agent rollouts (v0.11.2, `agent_func_path`) run as OpenRLHF
runs them: inside the engine actor, by OpenRLHF's own executor, with the
actor as its `llm_engine`.

OpenRLHF's `RolloutRayActor` (openrlhf/trainer/ray/vllm_engine.py) loads
the `AgentExecutor` class of the file `agent_func_path` names (its
`MultiTurnAgentExecutor` with the user's `AgentInstanceBase`), or a
`SingleTurnAgentExecutor` without one, and its trainer calls
`generate_responses` on the engine per prompt
(trainer/ppo_utils/samples_generator.py, `_dispatch_prompts_to_vllm`).
`AgentApi` gives our engines that method, the same arguments and return
shape; `run_openrlhf_agent` runs one executor for the flow and returns the
rollout as a `TrajectorySample`.

OpenRLHF is an optional import (`pip install --no-deps openrlhf==0.11.2`:
`openrlhf.utils.agent` needs neither vLLM nor DeepSpeed); without it,
`agent_func_path` is refused before any engine is created.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import ray

from engines.client import translate_error
from engines.errors import EngineTimeoutError
from engines.openrlhf.executor import load_agent_executor
from engines.trajectory import NOT_SAMPLED, TrajectorySample, TurnSpan

#: Deadline of one agent rollout (`run_openrlhf_agent`): every turn's
#: generation plus the agent's own steps.
AGENT_TIMEOUT_S = 1800.0


@dataclass
class AgentRollout:
    """One agent rollout for the flow: its tokens as a trajectory, the
    executor's reward (None where it computed none: OpenRLHF's single-turn
    executor without a reward model) and the rest of its output (`scores`,
    `truncated`, `extra_logs`, `label`)."""

    sample: TrajectorySample
    reward: float | None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentPrompt:
    """One prompt as OpenRLHF's executors take it: the arguments of
    `AgentExecutorBase.execute` but `llm_engine`."""

    prompt: str
    label: Any
    sampling_params: Any
    max_length: int
    hf_tokenizer: Any
    images: Any = None

    def execute(self, executor: Any, llm_engine: Any) -> Awaitable[dict[str, Any]]:
        # The fields are named as `execute`'s parameters.
        return executor.execute(**vars(self), llm_engine=llm_engine)


class _Recorder:
    """The `llm_engine` handed to the executor by `agent_rollout`: the engine
    itself, keeping each turn's output for its weight versions."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.outputs: list[Any] = []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        output = await self.engine.generate(
            prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data
        )
        self.outputs.append(output)
        return output


class AgentApi:
    """The engine actor's side: OpenRLHF's `generate_responses`, and
    `agent_rollout` for `run_openrlhf_agent`. The engine's `config` carries
    `agent_func_path`; each executor is loaded once per actor, on first use."""

    def _agent_executor(self, path: str | None) -> Any:
        executors = self.__dict__.setdefault("_agent_executors", {})
        if path not in executors:
            executors[path] = load_agent_executor(path)
        return executors[path]

    async def generate_responses(
        self,
        prompt: str,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        num_samples: int = 1,
        images: Any = None,
    ) -> list[dict[str, Any]]:
        """OpenRLHF's `RolloutRayActor.generate_responses` (v0.11.2):
        `num_samples` executions of the engine's executor, concurrently; one
        executor output dict each (observation_tokens, action_ranges,
        rollout_log_probs, reward, scores, truncated, extra_logs, ...)."""
        request = AgentPrompt(prompt, label, sampling_params, max_length, hf_tokenizer, images)
        executor = self._agent_executor(self.config.agent_func_path)
        return await asyncio.gather(*(request.execute(executor, self) for _ in range(num_samples)))

    async def agent_rollout(
        self, request: AgentPrompt, agent_func_path: str | None
    ) -> AgentRollout:
        """One execution of `agent_func_path`'s executor, as
        `generate_responses` runs it, turned into an `AgentRollout`."""
        recorder = _Recorder(self)
        output = await request.execute(self._agent_executor(agent_func_path), recorder)
        return agent_rollout(output, recorder.outputs, self.config.name)


def agent_rollout(output: dict[str, Any], turns: list[Any], engine: str) -> AgentRollout:
    """An executor's output as a trajectory: the observation up to the first
    action is the prompt, the rest the response; mask 1 inside the action
    ranges (one per engine output in `turns`, in order), 0 elsewhere."""
    tokens = list(output["observation_tokens"])
    ranges = [tuple(span) for span in output["action_ranges"]]
    start = ranges[0][0] if ranges else len(tokens)
    logprobs = output.get("rollout_log_probs") or [0.0] * len(tokens)
    mask = [0] * len(tokens)
    versions = [NOT_SAMPLED] * len(tokens)
    spans: list[TurnSpan] = []
    position = start
    # OpenRLHF's executors make one request per action range; a custom one
    # that does not gets the oldest version of its requests on every range.
    if len(turns) != len(ranges):
        turns = [min(turns, key=lambda turn: turn.weight_version)] * len(ranges) if turns else []
    for (begin, end), turn in zip(ranges, turns, strict=True):
        if begin > position:
            spans.append(TurnSpan(role="environment", start=position - start, stop=begin - start))
        spans.append(
            TurnSpan(role="assistant", start=begin - start, stop=end - start, engine=engine)
        )
        mask[begin:end] = [1] * (end - begin)
        versions[begin:end] = token_versions(turn, end - begin)
        position = end
    if position < len(tokens):
        spans.append(TurnSpan(role="environment", start=position - start, stop=len(tokens) - start))
    sample = TrajectorySample(
        prompt_token_ids=tokens[:start],
        response_token_ids=tokens[start:],
        loss_mask=mask[start:],
        logprobs=[lp if m else 0.0 for lp, m in zip(logprobs[start:], mask[start:], strict=True)],
        token_versions=versions[start:],
        turns=spans,
    )
    info = {
        "scores": number(output.get("scores")),
        "truncated": bool(output.get("truncated", False)),
        # As OpenRLHF's trainer reads them (samples_generator.py,
        # _process_response_into_experience).
        "extra_logs": {key: number(value) for key, value in output.get("extra_logs", {}).items()},
        "label": output.get("label"),
    }
    reward = number(output.get("reward"))
    return AgentRollout(sample=sample, reward=None if reward is None else float(reward), info=info)


def number(value: Any) -> Any:
    """A tensor as its first value (OpenRLHF's agents return torch scalars)."""
    if hasattr(value, "flatten"):
        return value.flatten()[0].item()
    return value


def token_versions(output: Any, count: int) -> list[int]:
    """The weight version of each sampled token of one turn: the backend's
    per-token versions where its output has them, else the version the
    request was admitted under."""
    completion = output.outputs[0]
    per_token = getattr(completion, "token_versions", None)
    if per_token is not None and len(per_token) == count:
        return list(per_token)
    return [output.weight_version] * count


async def run_openrlhf_agent(
    engine: Any,
    *,
    prompt: str,
    label: Any,
    sampling_params: Any,
    max_length: int,
    agent_func_path: str | None,
    tokenizer: Any,
    timeout_s: float = AGENT_TIMEOUT_S,
) -> AgentRollout:
    """Run OpenRLHF's executor for `agent_func_path` (None: its single-turn
    executor) on `engine`'s actor, as its trainer's `generate_responses`
    call does, for one sample. Raises the engine's error, `EngineDeadError`
    or `EngineTimeoutError` after `timeout_s`."""
    request = AgentPrompt(prompt, label, sampling_params, max_length, tokenizer)
    ref = engine.agent_rollout.remote(request, agent_func_path)
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except TimeoutError:
        ray.cancel(ref)
        raise EngineTimeoutError(f"agent rollout took longer than {timeout_s:g}s") from None
    except Exception as exc:  # noqa: BLE001 - translated and re-raised
        raise translate_error(exc, "engine") from exc
