"""Agent sessions through the run's router URL, sticky routing against round
robin on the same trace, printed side by side. Not a test: it reports numbers.

    python3 benchmarks/agent_replay.py [--clients 8] [--repeats 2] [--json out.json]  # GPU
    python3 benchmarks/agent_replay.py --backend hf --small                          # CPU

The trace, an agent's: --sessions sessions of --turns chat turns each, all
sharing a system prompt of --system-tokens tokens; each turn sends a tool's
result of --tool-tokens tokens (one token a byte with the benchmark's
byte-level models) and samples --answer-tokens tokens; the sessions run
concurrently, each its turns in order. Two engines behind `start_router`
(sharing one GPU when the host has one). Round robin is the router's own
per-request round robin, on the same trace and engines.

The sessions are spread over --clients processes (each its share, all at
once): an agent fleet runs many processes, and the `openai` client's CPU a
request on one thread would otherwise set the pace of both routings alike.
The first repeat also runs each routing from one process ("x1"), so that
figure is printed too. After an untimed warm-up, each routing runs --repeats
times from the client processes, alternating, on engines whose prefix caches
were reset before each run.

Printed for each run: wall seconds, turns per second, the prefix-cache hit
ratio (cached / prompt tokens, summed over the responses' `usage`); then the
uncached prompt tokens each routing must prefill (the trace's, by a model of
the routing, and as measured): their ratio bounds the sticky gain when prefill
is all the work (decode is the same under both). Then sticky / round robin
for throughput (target >= 1.3) and the sticky hit ratio (target >= 0.85). The
CPU backend has no prefix cache: its ratio is 0 and only exercises the code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from endpoint_engines import add_engine_arguments, in_clients, serve  # noqa: E402

ROUTINGS = ("sticky", "round_robin")
ENGINES = 2
REQUEST_TIMEOUT_S = 600
WORDS = "file line error test passed failed value index module call returned expected".split()


@dataclass
class Replay:
    routing: str
    clients: int
    seconds: float
    turns: int
    prompt_tokens: int
    cached_tokens: int
    #: Per session, per turn: (prompt tokens, sampled tokens).
    lengths: list[list[tuple[int, int]]]

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.seconds


def tool_result(args, session: int, turn: int) -> str:
    """What the agent's tool returned: --tool-tokens bytes, the session's own."""
    rng = random.Random(session * 1009 + turn)
    text = f"Session {session}, tool call {turn} returned:"
    while len(text) < args.tool_tokens:
        text += f" {rng.choice(WORDS)} {rng.randrange(1000)}"
    return text[: args.tool_tokens]


async def replay_client(index: int, clients: int, payload, start) -> list[tuple[int, list]]:
    """One client process's sessions (every clients-th): (session, its turns' usage)."""
    import openai

    plain_url, urls, api_key, model, args = payload
    async with openai.AsyncOpenAI(base_url=plain_url, api_key=api_key, max_retries=0) as client:
        # Warm-up, outside any session: a tiny prompt, nothing the trace's prefixes hold.
        warm = [{"role": "user", "content": f"client {index}"}]
        await client.chat.completions.create(model=model, messages=warm, max_tokens=1)
    await start()
    system = "".join(f"Rule {i}: answer briefly and cite the tool's result. " for i in range(999))
    system = system[: args.system_tokens]

    async def session(i: int) -> tuple[int, list]:
        usage = []
        async with openai.AsyncOpenAI(
            base_url=urls[i], api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
        ) as client:
            messages = [{"role": "system", "content": system}]
            for k in range(args.turns):
                messages.append({"role": "user", "content": tool_result(args, i, k)})
                reply = await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=args.answer_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                details = reply.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
                usage.append((reply.usage.prompt_tokens, cached, reply.usage.completion_tokens))
        return i, usage

    return list(await asyncio.gather(*(session(i) for i in range(index, args.sessions, clients))))


def replay(router, routing: str, clients: int, args, served, tag: str) -> Replay:
    import ray

    urls = [router.session_url(f"{tag}-{i}") for i in range(args.sessions)]
    payload = (f"{router.url}/v1", urls, served.api_key, served.model, args)
    run = in_clients(replay_client, clients, payload)
    for i in range(args.sessions):  # the router forgets them
        ray.get(router.actor.take_trajectory.remote(f"{tag}-{i}"), timeout=60)
    usage = dict(s for client in run.results for s in client)
    turns = [usage[i] for i in range(args.sessions)]
    flat = [t for session in turns for t in session]
    return Replay(
        routing,
        clients,
        run.seconds,
        len(flat),
        sum(t[0] for t in flat),
        sum(t[1] for t in flat),
        [[(t[0], t[2]) for t in session] for session in turns],
    )


def uncached_model(lengths: list[list[tuple[int, int]]], shared: int) -> dict[str, float]:
    """Prompt tokens each routing leaves to prefill, by turn lengths (up to
    the cache's block rounding). Sticky: a session's engine holds all of it
    but the new turn (and the `shared` system prompt from the start). Round
    robin: a turn lands on either engine alike, which holds the session up to
    the last turn it served there (j turns back with probability
    (1/E)(1-1/E)^(j-1)), else the system prompt only."""
    miss = 1 - 1 / ENGINES
    sticky = robin = 0.0
    for session in lengths:
        held = [prompt + sampled for prompt, sampled in session]  # the cache after each turn
        for k, (prompt, _) in enumerate(session):
            sticky += prompt - (held[k - 1] if k else shared)
            expected = shared * miss**k
            expected += sum(held[j] * (1 - miss) * miss ** (k - 1 - j) for j in range(k))
            robin += prompt - expected
    return {"sticky": sticky, "round_robin": robin}


def run(args) -> list[Replay]:
    import ray

    from agents.router.actor import start_router

    served = serve(args, ENGINES, prefix_caching=True, name="agent-replay")
    runs: list[Replay] = []
    try:
        # Untimed: the first requests pay for connections and warm-ups.
        warm = start_router(list(served.engines), served.api_key)
        try:
            replay(warm, "sticky", args.clients, args, served, "warm-up")
        finally:
            warm.close()
        for repeat in range(args.repeats):
            for routing in ROUTINGS if repeat % 2 == 0 else ROUTINGS[::-1]:
                for clients in dict.fromkeys((args.clients, 1) if repeat == 0 else (args.clients,)):
                    ray.get([e.reset_prefix_cache.remote() for e in served.engines], timeout=60)
                    router = start_router(list(served.engines), served.api_key, routing)
                    try:
                        tag = f"{routing}-{repeat}-{clients}"
                        result = replay(router, routing, clients, args, served, tag)
                    finally:
                        router.close()
                    runs.append(result)
                    print(
                        f"{routing:>11} x{clients}: {result.turns} turns in {result.seconds:6.1f}s "
                        f"({result.turns_per_s:6.1f}/s), cache hit {result.hit_ratio:.3f}"
                    )
    finally:
        served.close()
    return runs


def report(runs: list[Replay], args) -> dict:
    fanned = [r for r in runs if r.clients == args.clients]

    def median(value) -> dict[str, float]:
        return {r: statistics.median(value(x) for x in fanned if x.routing == r) for r in ROUTINGS}

    rate, hit = median(lambda x: x.turns_per_s), median(lambda x: x.hit_ratio)
    measured = median(lambda x: x.prompt_tokens - x.cached_tokens)
    single = {x.routing: x.turns_per_s for x in runs if x.clients == 1}
    model = uncached_model(fanned[0].lengths, args.system_tokens)
    decode = sum(s for session in fanned[0].lengths for _, s in session)
    print(
        f"uncached prompt tokens: sticky {model['sticky']:.0f} (measured "
        f"{measured['sticky']:.0f}), round robin {model['round_robin']:.0f} (measured "
        f"{measured['round_robin']:.0f}); "
        f"bound on the gain if prefill were all the work: "
        f"{model['round_robin'] / model['sticky']:.2f}x; decode tokens under both: {decode}"
    )
    ratio = rate["sticky"] / rate["round_robin"]
    print(
        f"sticky / round robin throughput x{args.clients}: {ratio:.2f}x (target >= 1.3), "
        f"x1: {single['sticky'] / single['round_robin']:.2f}x; cache hit sticky "
        f"{hit['sticky']:.3f} (target >= 0.85), round robin {hit['round_robin']:.3f}"
    )
    return {"throughput_ratio": ratio, "hit": hit, "uncached_model": model, "measured": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--tool-tokens", type=int, default=192)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.small:
        args.sessions, args.turns, args.system_tokens, args.tool_tokens = 4, 3, 256, 64
        args.answer_tokens, args.repeats, args.max_len, args.clients = 4, 1, 1024, 2
    runs = run(args)
    figures = report(runs, args)
    if args.json:
        figures["runs"] = [asdict(r) for r in runs]
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
