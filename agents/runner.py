"""Running agents in the flow: each prompt's `n` sessions run an agent, and
what the engines sampled in them comes back as trajectories
(engines/trajectory.py).

Two kinds of agent:

- `--agent module:function` (or `file.py:function`): an async function
  `agent(client: openai.AsyncOpenAI, row: dict) -> AgentResult` (or a
  `(reward, info)` tuple; agents/contract.py), found by its reference
  (agents/loading.py). Its client is bound to its own session on the
  run's router (`<router>/sessions/<id>/v1`), so every request of the session
  lands on one engine and the router keeps its exact tokens; `row` is the
  prompt's input row. After the call the flow takes the session's
  trajectory from the router.
- `--agent-func-path file.py`: OpenRLHF's `AgentInstanceBase` file, run as
  OpenRLHF runs it (engines/openrlhf/agents.py) on the engine the shard went to.

A prompt's sessions run concurrently in one Ray task (the shard dispatch in
tasks/run/dispatch.py waits on one ref per prompt); each agent call has a
deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray

from agents.contract import AgentError, AgentFunction, as_result
from agents.loading import AgentRef
from engines.trajectory import TrajectorySample

#: Deadline of one call to the router (taking a trajectory).
ROUTER_CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class AgentPlan:
    """Plain data: how an iteration's sessions reach the engines."""

    #: The `--agent` function's reference (each task loads it), or None with `func_path`.
    agent: AgentRef | None
    #: OpenRLHF's AgentInstanceBase file (absolute), or None with `agent`.
    func_path: str | None
    timeout_s: float
    #: The router's URL and bearer token, and its actor (`take_trajectory`).
    router_url: str | None = None
    api_key: str | None = None
    router: Any = None
    #: The model (its tokenizer decodes the rows' text); for `func_path`
    #: also the requests' sampling and the context budget.
    model: str | None = None
    sampling: Any = None
    max_length: int = 0


@dataclass(frozen=True)
class AgentSession:
    """One session's outcome: its samples in order (more than one when the
    router split it), the agent's reward and info."""

    session_id: str
    samples: list[TrajectorySample]
    reward: float
    info: dict[str, Any]


async def run_session(
    agent: AgentFunction, plan: AgentPlan, row: dict[str, Any], session_id: str
) -> AgentSession:
    """One agent call on its own session, within the plan's deadline; then
    the session's trajectory from the router (which forgets the session)."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{plan.router_url}/sessions/{session_id}/v1",
        api_key=plan.api_key,
        timeout=plan.timeout_s,
        max_retries=0,
    )
    where = f"agent {plan.agent} on session {session_id}"
    failure: AgentError | None = None
    try:
        async with client:
            value = await asyncio.wait_for(agent(client, row), plan.timeout_s)
    except TimeoutError as exc:
        failure = AgentError(f"{where} did not finish within {plan.timeout_s:g}s")
        failure.__cause__ = exc
    except Exception as exc:
        # Ours: the flow gets it through Ray, which cannot rebuild every
        # library's exception (openai's APIStatusError needs its response).
        failure = AgentError(f"{where} raised {exc!r}")
        failure.__cause__ = exc
    # Taken either way (the router forgets the session); a failed agent's
    # error wins over the router's (a session that never sent a turn).
    taking = plan.router.take_trajectory.remote(session_id)
    try:
        samples = await asyncio.wait_for(taking, ROUTER_CALL_TIMEOUT_S)
    except Exception:
        if failure is None:
            raise
    if failure is not None:
        raise failure
    result = as_result(value, where)
    return AgentSession(session_id, list(samples), result.reward, result.info)


async def run_openrlhf_session(
    plan: AgentPlan, engine: Any, row: dict[str, Any], session_id: str
) -> AgentSession:
    from transformers import AutoTokenizer

    from engines.openrlhf.agents import run_openrlhf_agent

    rollout = await run_openrlhf_agent(
        engine,
        prompt=row["prompt"],
        label=row.get("label"),
        sampling_params=plan.sampling.model_copy(),
        max_length=plan.max_length,
        agent_func_path=plan.func_path,
        tokenizer=AutoTokenizer.from_pretrained(plan.model),
        timeout_s=plan.timeout_s,
    )
    return AgentSession(session_id, [rollout.sample], float(rollout.reward), dict(rollout.info))


@ray.remote(num_cpus=0, max_retries=0)
def run_prompt(
    plan: AgentPlan, engine: Any, row: dict[str, Any], session_ids: list[str]
) -> list[AgentSession]:
    """A prompt's sessions, concurrently (in a Ray task: the dispatch waits
    on one ref per prompt, and an agent's blocking code stalls no flow thread)."""
    agent = plan.agent.load() if plan.agent is not None else None

    async def one(session_id: str) -> AgentSession:
        if agent is None:
            return await run_openrlhf_session(plan, engine, row, session_id)
        return await run_session(agent, plan, row, session_id)

    async def sessions() -> list[AgentSession]:
        return list(await asyncio.gather(*(one(s) for s in session_ids)))

    return asyncio.run(sessions())
