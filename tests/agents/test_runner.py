"""Agent functions as the flow takes them: refused before anything starts
when they cannot run, their results in one typed shape."""

from __future__ import annotations

import pytest

from agents import tool_task
from agents.runner import AgentError, AgentResult, as_result, check_func_path, load_agent
from flows.params import RolloutParams, sectioned
from flows.rollout import check_settings


def write(tmp_path, text: str) -> str:
    path = tmp_path / "my_agent.py"
    path.write_text(text)
    return str(path)


def test_an_async_function_loads_by_module_or_file(tmp_path):
    assert load_agent("agents.tool_task:agent") is tool_task.agent
    path = write(tmp_path, "async def agent(client, row):\n    return 1.0, {}\n")
    assert load_agent(f"{path}:agent").__name__ == "agent"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("agents.tool_task", "must be 'package.module:function'"),
        ("no_such_module_xyz:agent", "cannot import 'no_such_module_xyz'"),
        ("agents.tool_task:nothing", "has no callable 'nothing'"),
        ("agents.tool_task:lookup", "is not async"),
        ("/nowhere/agent.py:agent", "cannot import '/nowhere/agent.py'"),
    ],
)
def test_an_agent_that_cannot_run_is_refused_naming_it(path, message):
    with pytest.raises(ValueError, match=message):
        load_agent(path)


def test_the_flow_checks_the_agent_before_anything_starts(tmp_path):
    def run(**values):
        return RolloutParams.model_validate(sectioned(values))

    with pytest.raises(ValueError, match="is not async"):
        check_settings(run(agent="agents.tool_task:lookup"))
    with pytest.raises(ValueError, match="agent_func_path '/nowhere/agent_func.py'"):
        check_settings(run(agent_func_path="/nowhere/agent_func.py"))
    check_settings(run(agent="agents.tool_task:agent"))
    assert check_func_path(write(tmp_path, "")) == str(tmp_path / "my_agent.py")


def test_results_come_as_agent_result_or_a_pair():
    assert as_result(AgentResult(0.5, {"a": 1}), "x") == AgentResult(0.5, {"a": 1})
    assert as_result((1, {"turns": 2}), "x") == AgentResult(1.0, {"turns": 2})
    with pytest.raises(AgentError, match="agent f returned 0.5: expected AgentResult"):
        as_result(0.5, "agent f")


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
    plan = AgentPlan("my:agent", None, 5.0, router_url="http://router", api_key="k", router=router)
    with pytest.raises(AgentError) as raised:
        asyncio.run(run_session(agent, plan, {"prompt": "?"}, "s0"))
    again = pickle.loads(pickle.dumps(raised.value))
    assert "agent my:agent on session s0 raised InternalServerError" in str(again)
    assert "no engine served the request" in str(again)
