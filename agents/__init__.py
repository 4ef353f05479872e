"""Agents: multi-turn rollouts in which your code talks to the engines.

An agent is an async function `agent(client, row)`: `client` an
`openai.AsyncOpenAI` bound to a session of its own on the run's router,
`row` the prompt's input row; it returns an `AgentResult` (the session's
reward and anything to log) or a `(reward, info)` tuple. A run takes it as
`--agent module:function` or `--agent file.py:function`; every token the
engines sampled in the session comes back as a trajectory to train on.

Where each piece lives:

- `agents.contract`: `AgentResult`, `AgentError`, `AgentFunction` (the
  agent's type), `as_result`.
- `agents.loading`: `AgentRef` (an `--agent` value parsed once), `load_agent`,
  and the check of OpenRLHF's `--agent-func-path` file.
- `agents.runner`: sessions run in the run's warm runners (`AgentRunner`),
  `--agent` ones through the router, OpenRLHF's on an engine.
- `agents.router`: the router (one URL per run, sticky sessions, exact tokens).
- `agents.tool_task`: the demo tool task and its agent (`make run-agent`).

docs/agents.md tells the whole story.
"""

from agents.contract import AgentError, AgentFunction, AgentResult
from agents.loading import load_agent

__all__ = ["AgentError", "AgentFunction", "AgentResult", "load_agent"]
