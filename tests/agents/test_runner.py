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
