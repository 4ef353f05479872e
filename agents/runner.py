"""Running agents in the flow: each prompt's `n` samples are agent sessions,
and what the engines sampled in them comes back as trajectories
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

Sessions run in warm runners (`AgentRunner`): Ray actors started with the
run, one per node that holds engines, reused every iteration. Each loads the
agent once and runs sessions as asyncio tasks in its event loop, a bounded
number at a time. A fresh Ray task per prompt instead started worker
processes that each imported openai and the agent again (Ray reaps idle
workers past its soft limit, about one per CPU), which took most of an
iteration's seconds on a small machine. Each agent call has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agents.contract import AgentError, AgentFunction, as_result
from agents.loading import AgentRef
from engines.trajectory import TrajectorySample

#: Deadline of one call to the router (taking a trajectory).
ROUTER_CALL_TIMEOUT_S = 30.0
#: Sessions one runner runs at once; the dispatch's shard windows bound what
#: is sent, this bounds what a runner holds whatever is sent.
SESSIONS_PER_RUNNER = 512
#: A session whose engines all failed under it (the router's 503: it found no
#: engine to serve a turn) runs again from scratch, on a new session, at most
#: this many times; its first try's turns are taken and dropped.
SESSION_RETRIES = 2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentPlan:
    """Plain data: how an iteration's sessions reach the engines."""

    #: The `--agent` function's reference (each runner loads it), or None with `func_path`.
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
    #: The run's warm runners (`AgentRunners`), where the sessions run.
    runners: Any = None


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
    plan: AgentPlan, engine: Any, row: dict[str, Any], session_id: str, tokenizer: Any
) -> AgentSession:
    from engines.openrlhf.agents import run_openrlhf_agent

    rollout = await run_openrlhf_agent(
        engine,
        prompt=row["prompt"],
        label=row.get("label"),
        sampling_params=plan.sampling.model_copy(),
        max_length=plan.max_length,
        agent_func_path=plan.func_path,
        tokenizer=tokenizer,
        timeout_s=plan.timeout_s,
    )
    return AgentSession(session_id, [rollout.sample], float(rollout.reward), dict(rollout.info))


class AgentRunner:
    """A warm runner (a Ray actor, asyncio inside): the agent loaded once,
    its sessions run in the actor's event loop, at most `max_sessions` at a
    time (the others wait their turn here)."""

    def __init__(self, plan: AgentPlan, max_sessions: int) -> None:
        self.plan = plan
        # Loaded here, once: a bad agent fails the runner's start, named.
        self.agent = plan.agent.load() if plan.agent is not None else None
        self.slots = asyncio.Semaphore(max_sessions)
        self._tokenizer: Any = None

    async def ready(self) -> int:
        """Answers once the agent is loaded: the runner's process id."""
        return os.getpid()

    async def run_prompt(
        self, engine: Any, row: dict[str, Any], session_ids: list[str]
    ) -> list[AgentSession]:
        """A prompt's sessions, concurrently; `engine`: where OpenRLHF's run
        (an `--agent`'s go through the router)."""
        return list(await asyncio.gather(*(self._one(engine, row, s) for s in session_ids)))

    async def _one(self, engine: Any, row: dict[str, Any], session_id: str) -> AgentSession:
        async with self.slots:
            if self.agent is not None:
                return await self._session(row, session_id)
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.plan.model)
            return await run_openrlhf_session(self.plan, engine, row, session_id, self._tokenizer)

    async def _session(self, row: dict[str, Any], session_id: str) -> AgentSession:
        session, retries = session_id, 0
        while True:
            try:
                return await run_session(self.agent, self.plan, row, session)
            except AgentError as exc:
                retries += 1
                if retries > SESSION_RETRIES or not no_engine_served(exc):
                    raise
                session = f"{session_id}-again{retries}"
                logger.warning("%s; running it again from scratch as %s", exc, session)


def no_engine_served(error: AgentError) -> bool:
    """The agent failed on the router's 503: the session's engine died and
    no other could take its turn (the router moves a session itself when one can)."""
    return getattr(error.__cause__, "status_code", None) == 503


@dataclass(frozen=True)
class AgentRunners:
    """The run's runners: a prompt's sessions go to one of them (`pick`)."""

    handles: tuple[Any, ...]

    def pick(self, prompt_index: int) -> Any:
        return self.handles[prompt_index % len(self.handles)]

    def close(self) -> None:
        """End every runner (a session still running in one ends with it)."""
        for handle in self.handles:
            ray.kill(handle, no_restart=True)


def start_runners(
    plan: AgentPlan,
    nodes: list[str | None],
    names: list[str],
    namespace: str | None,
    timeout_s: float,
    max_sessions: int = SESSIONS_PER_RUNNER,
) -> AgentRunners:
    """One runner per node of `nodes` (a node id, placed there while it has
    room; None: anywhere), named `names`; returns once each has loaded the
    agent (within `timeout_s`). A runner that fails to start ends the others."""
    handles = []
    for node, name in zip(nodes, names, strict=True):
        where = {}
        if node is not None:
            where["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        options = dict(num_cpus=0, max_restarts=0, name=name, namespace=namespace, **where)
        handles.append(ray.remote(AgentRunner).options(**options).remote(plan, max_sessions))
    runners = AgentRunners(tuple(handles))
    try:
        ray.get([handle.ready.remote() for handle in handles], timeout=timeout_s)
    except BaseException:
        runners.close()
        raise
    return runners
