"""The agent contract: an agent's results in one typed shape."""

from __future__ import annotations

import pytest

from agents.contract import AgentError, AgentResult, as_result


def test_results_come_as_agent_result_or_a_pair():
    assert as_result(AgentResult(0.5, {"a": 1}), "x") == AgentResult(0.5, {"a": 1})
    assert as_result((1, {"turns": 2}), "x") == AgentResult(1.0, {"turns": 2})
    with pytest.raises(AgentError, match="agent f returned 0.5: expected AgentResult"):
        as_result(0.5, "agent f")


def test_the_package_exports_the_contract():
    import agents

    assert agents.AgentResult is AgentResult and agents.AgentError is AgentError
    assert agents.load_agent("agents.tool_task:agent").__name__ == "agent"
