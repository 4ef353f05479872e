"""The tool task's pieces and its agent's conversation (a stand-in client:
the task's run through the real endpoint is tests/flows/test_agent_flow.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from agents import tool_task


class ScriptedClient:
    """Answers each chat request with the next scripted reply; records the requests."""

    def __init__(self, replies: list[str]):
        self.replies, self.requests = list(replies), []
        self.models = SimpleNamespace(list=self._models)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _models(self):
        return SimpleNamespace(data=[SimpleNamespace(id="tiny")])

    async def _create(self, **request):
        self.requests.append(request)
        message = SimpleNamespace(content=self.replies.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def run(replies: list[str], answer: str = "a"):
    client = ScriptedClient(replies)
    row = {"prompt": tool_task.QUESTION, "label": answer}
    return asyncio.run(tool_task.agent(client, row)), client


def test_a_call_gets_the_tool_result_as_an_environment_message():
    result, client = run(["x@", "aab"])
    first, second = client.requests
    assert first["messages"] == [{"role": "user", "content": tool_task.QUESTION}]
    assert second["messages"][1:] == [
        {"role": "assistant", "content": "x@"},
        {"role": "tool", "tool_call_id": "lookup-0", "content": "a" * tool_task.RESULT_LENGTH},
    ]
    assert first["model"] == "tiny" and first["stop"] == ["\n"]
    assert result.reward == tool_task.CALL_BONUS + (1 - tool_task.CALL_BONUS) * 2 / 3
    assert result.info["called_tool"] and result.info["answer_score"] == 2 / 3


def test_a_guess_scores_less_than_a_right_answer_after_the_tool():
    result, client = run(["aaaa"])
    assert result.reward == tool_task.GUESS_WEIGHT and len(client.requests) == 1
    assert not result.info["called_tool"]
    assert run(["bb"])[0].reward == 0.0
    assert run(["@", "b b"], answer="b")[0].reward == 1.0
    # A call mark is no answer: "@@@@" after the tool scores the call alone.
    assert run(["@", "@@@@"])[0].reward == tool_task.CALL_BONUS
    assert run(["@", "@b@b"], answer="b")[0].reward == tool_task.CALL_BONUS + 0.8 / 2


def test_the_dataset_alternates_its_answers(tmp_path):
    path = tmp_path / "tool.jsonl"
    tool_task.main([str(path), "--count", "4"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["a", "b", "a", "b"]
    assert {r["prompt"] for r in rows} == {tool_task.QUESTION}
