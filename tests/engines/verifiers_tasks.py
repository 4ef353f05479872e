"""A verifiers (PrimeIntellect, `verifiers.v1`) environment for
tests/engines/test_verifiers_env.py, loaded by verifiers from its taskset id
`verifiers_tasks` (this module's name) as any plugin is: the module's
`__all__` exports its Taskset and its default Harness.

The task: a prompt of one letter repeated; the reward (a verifiers
`@vf.reward`) is the fraction of the last reply's characters that are that
letter. The harness is a chat loop run in-process, as `Harness.launch`'s
contract allows: verifiers' own `null` chat program is a PEP 723 script that
`uv` installs from PyPI, which a CI box without the network cannot do. Every
model call goes through verifiers' interception server (`endpoint`,
`secret`), which relays it with verifiers' `EvalClient` to the run's endpoint.
"""

from __future__ import annotations

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

#: Tokens per reply: a few, the tiny model's text is random.
MAX_TOKENS = 6
#: The user's message after each reply but the last (a multi-turn run).
AGAIN = "again"


def letter_fraction(reply: str, letter: str) -> float:
    return sum(c == letter for c in reply) / len(reply) if reply else 0.0


class LetterData(vf.TaskData):
    label: str


class LetterTask(vf.Task[LetterData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def letter(self, task: LetterData, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return letter_fraction(replies[-1].content or "" if replies else "", task.label)


class LetterTaskset(vf.Taskset[LetterTask, vf.TasksetConfig]):
    def load(self):
        for letter in "ab":
            yield LetterTask(LetterData(prompt=letter * 6, label=letter), self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    #: Model turns per run: the user says `AGAIN` after each reply but the last.
    turns: int = 1


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        messages = [{"role": "user", "content": data.prompt}]
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for turn in range(self.config.turns):
                if turn:
                    messages.append({"role": "user", "content": AGAIN})
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, max_tokens=MAX_TOKENS
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness", "LetterTaskset"]
