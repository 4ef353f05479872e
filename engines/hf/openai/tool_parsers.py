"""Tool-call parsers of the CPU backend, by vLLM's `tool_call_parser` names:
each turns a chat answer's text into (content, tool calls). Another parser is
one function and one line in `TOOL_PARSERS`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.errors import EngineSpecError


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def hermes(text: str) -> ParsedAnswer:
    """vLLM's "hermes" (`vllm/tool_parsers/hermes_tool_parser.py`): each
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` is a call, the
    text before the first one the content. Unparsable JSON: no calls, the
    whole text is the content (as vLLM)."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedAnswer(text)
    calls = []
    try:
        for closed, open_end in _HERMES.findall(text):
            call = json.loads(closed or open_end)
            calls.append(
                ParsedCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))
            )
    except (json.JSONDecodeError, KeyError, TypeError):
        return ParsedAnswer(text)
    return ParsedAnswer(text[:start] or None, calls)


TOOL_PARSERS: dict[str, Callable[[str], ParsedAnswer]] = {
    "hermes": hermes,
}


def check_tool_call_parser(name: str | None) -> None:
    """On the driver, before any engine exists (`HFEngine.check_settings`)."""
    if name is not None and name not in TOOL_PARSERS:
        raise EngineSpecError(
            f"tool_call_parser={name!r} is not one of backend 'hf''s {sorted(TOOL_PARSERS)}"
        )
