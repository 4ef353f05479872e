"""Agent sessions through the run's router URL, sticky routing against round
robin on the same trace, printed side by side. Not a test: it reports numbers.

    python3 benchmarks/agent_replay.py [--repeats 2] [--json out.json]   # GPU: two vLLM engines
    python3 benchmarks/agent_replay.py --backend hf --small               # CPU, small scale

The trace: --sessions sessions of --turns chat turns each, all sharing a
system prompt of --system-tokens tokens (one token a byte with the tiny
models), each turn answering --answer-tokens tokens; the sessions run
concurrently, each its turns in order. Two engines behind `start_router`
(sharing one GPU when the host has one). After an untimed warm-up, each
routing runs --repeats times, alternating, on engines whose prefix caches
were reset before each run.

Printed for each routing: wall seconds, turns per second, and the
prefix-cache hit ratio (cached / prompt tokens, summed over the responses'
`usage`); then sticky / round robin for throughput (target >= 1.3) and the
sticky hit ratio (target >= 0.85). The CPU backend has no prefix cache: its
ratio is 0 and only exercises the code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from endpoint_engines import add_engine_arguments, serve  # noqa: E402 - after the path

ROUTINGS = ("sticky", "round_robin")
REQUEST_TIMEOUT_S = 600


@dataclass
class Replay:
    routing: str
    seconds: float
    turns: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.seconds


async def replay(router, routing: str, args, served, tag: str) -> Replay:
    import openai

    system = "".join(f"Rule {i}: answer briefly and cite the tool's result. " for i in range(999))
    system = system[: args.system_tokens]
    usage = {"prompt": 0, "cached": 0}

    async def session(i: int) -> None:
        url = router.session_url(f"{tag}-{i}")
        async with openai.AsyncOpenAI(
            base_url=url, api_key=served.api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
        ) as client:
            messages = [{"role": "system", "content": system}]
            for k in range(args.turns):
                messages.append({"role": "user", "content": f"Session {i}, question {k}?"})
                reply = await client.chat.completions.create(
                    model=served.model,
                    messages=messages,
                    max_tokens=args.answer_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                usage["prompt"] += reply.usage.prompt_tokens
                details = reply.usage.prompt_tokens_details
                usage["cached"] += (details.cached_tokens or 0) if details else 0

    start = time.monotonic()
    await asyncio.gather(*(session(i) for i in range(args.sessions)))
    seconds = time.monotonic() - start
    for i in range(args.sessions):  # the router forgets them
        await router.actor.take_trajectory.remote(f"{tag}-{i}")
    turns = args.sessions * args.turns
    return Replay(routing, seconds, turns, usage["prompt"], usage["cached"])


def run(args) -> list[Replay]:
    import ray

    from engines.router import start_router

    served = serve(args, 2, prefix_caching=True, name="agent-replay")
    runs: list[Replay] = []
    try:
        # Untimed: the first requests pay for connections and warm-ups.
        warm = start_router(list(served.engines), served.api_key)
        try:
            asyncio.run(replay(warm, "sticky", args, served, "warm-up"))
        finally:
            warm.close()
        for repeat in range(args.repeats):
            for routing in ROUTINGS if repeat % 2 == 0 else ROUTINGS[::-1]:
                ray.get([e.reset_prefix_cache.remote() for e in served.engines], timeout=60)
                router = start_router(list(served.engines), served.api_key, routing)
                try:
                    tag = f"{routing}-{repeat}"
                    result = asyncio.run(replay(router, routing, args, served, tag))
                finally:
                    router.close()
                runs.append(result)
                print(
                    f"{routing:>11}: {result.turns} turns in {result.seconds:6.1f}s "
                    f"({result.turns_per_s:6.1f}/s), cache hit {result.hit_ratio:.3f}"
                )
    finally:
        served.close()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.small:
        args.sessions, args.turns, args.system_tokens = 4, 3, 256
        args.answer_tokens, args.repeats, args.max_len = 4, 1, 1024
    runs = run(args)
    median = {r: statistics.median(x.turns_per_s for x in runs if x.routing == r) for r in ROUTINGS}
    hit = {r: statistics.median(x.hit_ratio for x in runs if x.routing == r) for r in ROUTINGS}
    ratio = median["sticky"] / median["round_robin"]
    print(
        f"sticky / round robin throughput: {ratio:.2f}x (target >= 1.3); cache hit "
        f"sticky {hit['sticky']:.3f} (target >= 0.85), round robin {hit['round_robin']:.3f}"
    )
    if args.json:
        figures = {"runs": [asdict(r) for r in runs], "throughput_ratio": ratio, "hit": hit}
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
