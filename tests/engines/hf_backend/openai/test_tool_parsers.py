"""The CPU backend's tool-call parsers (vLLM's "hermes" format), and a chat
choice built from an answer that calls tools."""

from __future__ import annotations

import json

from engines.hf.openai import protocol as p
from engines.hf.openai.chat import chat_choice
from engines.hf.openai.tool_parsers import TOOL_PARSERS, ParsedAnswer, ParsedCall, hermes
from engines.outputs import CompletionOutput

WEATHER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'


def test_hermes_parses_each_call_and_keeps_the_text_before_them():
    answer = hermes("Let me look.\n" + WEATHER + '\n<tool_call>{"name": "now"}</tool_call>')
    assert answer.content == "Let me look.\n"
    assert answer.calls == [
        ParsedCall("get_weather", json.dumps({"city": "Zürich"}, ensure_ascii=False)),
        ParsedCall("now", "{}"),
    ]
    assert hermes(WEATHER).content is None


def test_hermes_takes_an_unclosed_last_call_and_refuses_bad_json_as_vllm():
    unclosed = hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert unclosed.calls == [ParsedCall("f", '{"x": 1}')]
    for text in ("no call here", "<tool_call>{not json}</tool_call>", "<tool_call>[1]</tool_call>"):
        assert hermes(text) == ParsedAnswer(text)
    assert TOOL_PARSERS["hermes"] is hermes


def test_a_chat_choice_reports_parsed_calls_as_openai_tool_calls():
    said = CompletionOutput(0, [1, 2], "Checking. " + WEATHER, "stop", token_versions=[3, 4])
    choice = chat_choice(said, "auto", hermes, None, True)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Zürich"},
    )
    assert (choice.token_ids, choice.token_versions) == ([1, 2], [3, 4])
    plain = chat_choice(said, "none", hermes, None, False)
    assert plain.message.content == said.text and plain.message.tool_calls == []
    assert plain.finish_reason == "stop" and plain.token_ids is None
    named = p.ChatCompletionNamedToolChoiceParam(function={"name": "get_weather"})
    forced = chat_choice(CompletionOutput(0, [1], '{"city": "Bern"}', "stop"), named, None, None, 0)
    assert forced.message.tool_calls[0].function.arguments == '{"city": "Bern"}'
    required = chat_choice(
        CompletionOutput(0, [1], '[{"name": "f", "parameters": {"a": 1}}]', "stop"),
        "required",
        None,
        None,
        False,
    )
    assert [c.function.name for c in required.message.tool_calls] == ["f"]
    assert required.finish_reason == "tool_calls"


def test_required_without_a_call_returns_the_text_not_nothing():
    """vLLM's guided decoding makes a "required" answer a non-empty call list;
    this backend cannot, so an answer holding no call keeps its text."""
    for text in ("{}", "[]", '{"name": "f"}', '[{"parameters": {}}]', "plain words"):
        said = CompletionOutput(0, [1], text, "stop")
        choice = chat_choice(said, "required", None, None, False)
        assert (choice.message.content, choice.message.tool_calls) == (text, [])
        assert choice.finish_reason == "stop"
    hermes_call = chat_choice(
        CompletionOutput(0, [1], WEATHER, "stop"), "required", hermes, None, 0
    )
    assert [c.function.name for c in hermes_call.message.tool_calls] == ["get_weather"]
    assert hermes_call.finish_reason == "tool_calls"
    two = '[{"name": "f", "parameters": null}, {"name": "g"}]'
    listed = chat_choice(CompletionOutput(0, [1], two, "stop"), "required", hermes, None, 0)
    assert [(c.function.name, c.function.arguments) for c in listed.message.tool_calls] == [
        ("f", "{}"),
        ("g", "{}"),
    ]
    assert listed.message.content is None
