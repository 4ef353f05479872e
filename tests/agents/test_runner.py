"""Running agent sessions: an agent's failure reaches the flow as ours.
Loading agents: test_loading.py; their results: test_contract.py."""

from __future__ import annotations

import pytest

from agents.contract import AgentError
from agents.loading import AgentRef


def test_an_agents_error_reaches_the_flow_as_ours_naming_it():
    """openai's status errors cannot be rebuilt by Ray (their constructor wants
    the response): the flow got 'Failed to deserialize exception' instead.
    And the agent's error wins over the router's about a session with no turn."""
    import asyncio
    import pickle
    from types import SimpleNamespace

    import httpx
    import openai

    from agents.runner import AgentPlan, run_session

    async def agent(client, row):
        request = httpx.Request("POST", "http://router/v1/chat/completions")
        raise openai.InternalServerError(
            "no engine served the request",
            response=httpx.Response(503, request=request),
            body=None,
        )

    async def taken():  # the router never saw a turn of the session
        raise KeyError("no session 's0' (never seen, or already taken)")

    router = SimpleNamespace(take_trajectory=SimpleNamespace(remote=lambda session: taken()))
    plan = AgentPlan(
        AgentRef("my", "agent"), None, 5.0, router_url="http://router", api_key="k", router=router
    )
    with pytest.raises(AgentError) as raised:
        asyncio.run(run_session(agent, plan, {"prompt": "?"}, "s0"))
    again = pickle.loads(pickle.dumps(raised.value))
    assert "agent my:agent on session s0 raised InternalServerError" in str(again)
    assert "no engine served the request" in str(again)


#: An agent file that notes each load of its module, and the most sessions it
#: ran at once (each holds its slot until two run: a bound of one would hang).
COUNTING_AGENT = """
import asyncio, os
from pathlib import Path

with Path({log!r}).open("a") as log:
    log.write(f"{{os.getpid()}}\\n")
running = peak = 0
both = asyncio.Event()


async def agent(client, row):
    global running, peak
    running += 1
    peak = max(peak, running)
    if running == 2:
        both.set()
    await both.wait()
    running -= 1
    return 1.0, {{"pid": os.getpid(), "peak": peak}}
"""


def test_a_warm_runner_loads_its_agent_once_and_bounds_its_sessions(ray_local, tmp_path):
    """Every prompt's sessions, over iterations, run in the runner's one
    process, the agent loaded once (a task per prompt loaded it in each),
    at most `max_sessions` at a time; ending the runners ends their actors."""
    import ray

    from agents.runner import AgentPlan, start_runners

    class FakeRouter:  # here: pickled by value, for Ray's workers
        """The router as a runner sees it: sessions' trajectories to take."""

        def take_trajectory(self, session_id: str) -> list:
            return []

    loads = tmp_path / "loads.txt"
    path = tmp_path / "counting_agent.py"
    path.write_text(COUNTING_AGENT.format(log=str(loads)))
    router = ray.remote(FakeRouter).options(num_cpus=0).remote()
    plan = AgentPlan(
        AgentRef.parse(f"{path}:agent"),
        None,
        60.0,
        router_url="http://127.0.0.1:9",
        api_key="k",
        router=router,
    )
    runners = start_runners(plan, [None], ["test-runner0"], None, 120.0, max_sessions=2)
    try:
        calls = [
            runners.pick(i).run_prompt.remote(
                None, {"prompt": "?"}, [f"p{i}-s{k}" for k in range(3)]
            )
            for i in range(4)
        ]
        sessions = [s for prompt in ray.get(calls, timeout=120) for s in prompt]
    finally:
        runners.close()
        ray.kill(router)
    assert len(sessions) == 12 and {s.reward for s in sessions} == {1.0}
    (pid,) = {s.info["pid"] for s in sessions}
    assert loads.read_text().split() == [str(pid)]
    assert max(s.info["peak"] for s in sessions) == 2
    with pytest.raises(ValueError):  # the runner's name is free again: it ended
        ray.get_actor("test-runner0")


def test_a_session_no_engine_could_serve_runs_again_from_scratch():
    """The router's 503 (the session's engine died and no other took its
    turn): the session runs again on a new session id, its first try's
    turns taken and dropped; another error is not retried."""
    import asyncio
    from types import SimpleNamespace

    import httpx
    import openai

    from agents.runner import AgentPlan, AgentRunner

    taken = []

    async def take(session):
        taken.append(session)
        return []

    def failing(status):
        async def agent(client, row):
            if "again" not in str(client.base_url):
                request = httpx.Request("POST", "http://router/v1/chat/completions")
                response = httpx.Response(status, request=request)
                raise openai.APIStatusError("engine lost", response=response, body=None)
            return 1.0, {"url": str(client.base_url)}

        return agent

    router = SimpleNamespace(take_trajectory=SimpleNamespace(remote=take))
    plan = AgentPlan(None, None, 5.0, router_url="http://router", api_key="k", router=router)
    runner = AgentRunner(plan, 4)
    runner.agent = failing(503)
    (session,) = asyncio.run(runner.run_prompt(None, {"prompt": "?"}, ["s0"]))
    assert (session.session_id, taken) == ("s0-again1", ["s0", "s0-again1"])
    assert session.info["url"] == "http://router/sessions/s0-again1/v1/"
    runner.agent = failing(500)
    with pytest.raises(AgentError, match="engine lost"):
        asyncio.run(runner.run_prompt(None, {"prompt": "?"}, ["s1"]))
