"""A tool-use task the tiny model learns on CPU, and its agent
(`--agent agents.tool_task:agent`).

Every prompt is the same question ("?"); the answer, a or b, taking
turns across rows, is known only to the `lookup` tool. The model calls the
tool by writing the call mark `@` in its reply (the shortest tool-call text a
byte-level model can find by chance); the agent runs the tool and sends its
result as an environment message (role "tool": the answer letter repeated),
and the model answers. A reply without the call mark is the answer itself
(a guess: the question does not tell). Reward: the fraction of the answer's
characters that are the right letter (whitespace left out; a call mark in
the answer counts against it), times `GUESS_WEIGHT` for a guess, and for an
answer after the tool `CALL_BONUS` plus the rest times that fraction.
Guessing scores 0.25 on average at best, calling then always answering one
letter 0.6, calling then reading the result 1.0. The guess's score is what
first teaches the model to answer with a letter at all; were it worth as
much as an answer after the tool (0.8), always guessing one letter (0.4 on
average) beat calling, and runs settled there; with call marks left out of
the answer's score, runs settled on calling and answering "@@@@" (0.2).

The agent reads the call from the reply's text itself, so the task needs no
tool-call parser in the engine; the tool message carries a `tool_call_id`
as the OpenAI API asks.

    python -m agents.tool_task data/tool_task.jsonl   # writes the dataset
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from agents.contract import AgentResult

ALPHABET = "ab"
DATA_SOURCE = "tool_task"
QUESTION = "?"
CALL_MARK = "@"
#: The part of the reward for calling the tool: the first thing to learn.
CALL_BONUS = 0.2
#: What a guess's score is worth: below an answer after the tool.
GUESS_WEIGHT = 0.5
#: How often the tool's result repeats the answer: the tiny model learns to
#: read a long one (8 letters among the template's text were not learned in
#: 8 iterations; 32 were, measured with the agent forced to call).
RESULT_LENGTH = 32
#: Each reply: a few tokens, ending at a newline (the tiny model's chat
#: template ends every message with one, so the history re-renders exactly).
REPLY = {"max_tokens": 8, "temperature": 1.0, "stop": ["\n"], "logprobs": True}


def make_rows(count: int) -> list[dict[str, str]]:
    """Row i's answer is ALPHABET[i % 2]: always answering one letter scores
    half, only the tool's result tells which."""
    return [
        {
            "id": f"tool-{i:04d}",
            "prompt": QUESTION,
            "answer": ALPHABET[i % len(ALPHABET)],
            "data_source": DATA_SOURCE,
        }
        for i in range(count)
    ]


def lookup(answer: str) -> str:
    """The tool: the answer, repeated."""
    return answer * RESULT_LENGTH


def calls_tool(reply: str) -> bool:
    return CALL_MARK in reply


def score_answer(reply: str, answer: str) -> float:
    """The fraction of the reply's characters (whitespace left out) that
    are the answer."""
    text = "".join(reply.split())
    return sum(ch == answer for ch in text) / len(text) if text else 0.0


async def reply(client: Any, model: str, messages: list[dict[str, Any]]) -> str:
    response = await client.chat.completions.create(model=model, messages=messages, **REPLY)
    return response.choices[0].message.content or ""


async def agent(client: Any, row: dict[str, Any]) -> AgentResult:
    """One session: ask, run the tool when the reply calls it, ask again."""
    model = (await client.models.list()).data[0].id
    answer = str(row["label"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    first = await reply(client, model, messages)
    if not calls_tool(first):
        score = score_answer(first, answer)
        return AgentResult(
            GUESS_WEIGHT * score,
            {"called_tool": False, "answer": first, "answer_score": score},
        )
    messages = [
        *messages,
        {"role": "assistant", "content": first},
        {"role": "tool", "tool_call_id": "lookup-0", "content": lookup(answer)},
    ]
    final = await reply(client, model, messages)
    score = score_answer(final, answer)
    return AgentResult(
        CALL_BONUS + (1.0 - CALL_BONUS) * score,
        {"called_tool": True, "answer": final, "answer_score": score},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--count", type=int, default=16)
    args = parser.parse_args(argv)
    args.path.write_text("".join(json.dumps(row) + "\n" for row in make_rows(args.count)))


if __name__ == "__main__":
    main()
