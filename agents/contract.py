"""The agent contract: what an `--agent` function is and what it returns.

An agent is an async function `agent(client, row)`: `client` an
`openai.AsyncOpenAI` bound to its own session on the run's router, `row` the
prompt's input row (`id`, `prompt`, `label` and its metadata columns). It
returns an `AgentResult`, or a `(reward, info)` tuple that `as_result` takes
as one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


class AgentError(RuntimeError):
    """An agent raised, passed its deadline or returned something else than a result."""


@dataclass(frozen=True)
class AgentResult:
    """What an agent returns: the session's reward, and anything to log."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)


#: `async def agent(client: openai.AsyncOpenAI, row: dict) -> AgentResult`.
AgentFunction = Callable[[Any, dict[str, Any]], Awaitable[Any]]


def as_result(value: Any, where: str) -> AgentResult:
    """An agent's return value as an `AgentResult` (a `(reward, info)` tuple too)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value = AgentResult(float(value[0]), dict(value[1]))
    if not isinstance(value, AgentResult):
        raise AgentError(f"{where} returned {value!r}: expected AgentResult or (reward, info)")
    return value
