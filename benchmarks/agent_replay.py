"""Agent sessions through the run's router URL, sticky routing against round
robin on the same trace, printed side by side. Not a test: it reports numbers.

    python3 benchmarks/agent_replay.py [--clients 8] [--repeats 2] [--json out.json]  # GPU
    python3 benchmarks/agent_replay.py --shape 8b --engines 4 --trace coding          # GPU
    python3 benchmarks/agent_replay.py --backend hf --small [--engines 4 --trace coding]  # CPU

The trace (--trace, each setting overridable): --sessions sessions of
--turns chat turns each, all sharing a system prompt of --system-tokens
tokens; each turn sends a tool's result of --tool-tokens tokens (one token a
byte with the benchmark's byte-level models; "LO-HI": a length in that range
per turn) and samples --answer-tokens tokens; the sessions run concurrently,
each its turns in order.
- "agent": 64 sessions x 8 turns, 2,048-token system prompt, 192-token tool
  results.
- "coding", shaped like coding agents' sessions: 16 turns, 1,024-token system
  prompt, tool results of 256-512 tokens. Each session's turns take the 16
  lengths spread evenly over 256-512 in an order its seeded RNG draws: every
  session sends the same 6,144 tool tokens, so its last turn fits Llama-3-8B's
  8,192 positions (independent draws would push the longest of 64 sessions
  past them). 64 sessions, 16 per engine with 4: enough to keep the shared
  GPU busy, so the prefill round robin adds shows in the wall time, while 7
  passes over the trace (warm-up, x8 and x1 of each routing, a second x8
  of each) should stay near 6 minutes on one H200 with 4 engines of the 8B
  shape (an estimate from its prefill rate, not yet a measurement; 32
  sessions halve the passes).
Before any engine starts, the trace's longest prompt plus its answer is
checked against the engines' max length. With the byte-level models an
answer goes back into the history as ASCII ('?' for what is not), so it
takes at most --answer-tokens tokens there and the check is exact (a byte
that is no UTF-8 on its own would come back as U+FFFD, three tokens).

--engines engines behind `start_router` (sharing one GPU when the host has
one, each with 0.8 / N of its memory). Round robin is the router's own
per-request round robin, on the same trace and engines.

The sessions are spread over --clients processes (each its share, all at
once): an agent fleet runs many processes, and the `openai` client's CPU a
request on one thread would otherwise set the pace of both routings alike.
The first repeat also runs each routing from one process ("x1"), so that
figure is printed too. After an untimed warm-up, each routing runs --repeats
times from the client processes, alternating, on engines whose prefix caches
were reset before each run.

Printed for each run: wall seconds, turns per second, the prefix-cache hit
ratio (cached / prompt tokens, summed over the responses' `usage`), and per
engine what the router saw: requests, sessions placed, the usage's hit
ratio, the engine's own prefix-cache hits / lookups and its peak KV-cache
use (its `EngineLoad` reports); then the uncached prompt tokens each routing
must prefill (the trace's, by a model of the routing, and as measured): their
ratio bounds the sticky gain when prefill is all the work (decode is the same
under both). Then sticky / round robin for throughput (target >= 1.3) and the
sticky hit ratio (target >= 0.85). The CPU backend has no prefix cache: its
ratio is 0 and only exercises the code.
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

from endpoint_engines import add_engine_arguments, in_clients, max_len, serve  # noqa: E402

ROUTINGS = ("sticky", "round_robin")
REQUEST_TIMEOUT_S = 600
WORDS = "file line error test passed failed value index module call returned expected".split()


@dataclass(frozen=True)
class Trace:
    sessions: int
    turns: int
    system_tokens: int
    tool_tokens: tuple[int, int]  # a turn's tool result: from, to (inclusive)
    answer_tokens: int

    def tool_lengths(self, session: int) -> list[int]:
        """The session's tool results' lengths, turn by turn: the --turns
        lengths spread evenly over the range, in the session's seeded order."""
        low, high = self.tool_tokens
        step = (high - low) / max(1, self.turns - 1)
        lengths = [low + round(k * step) for k in range(self.turns)]
        random.Random(session).shuffle(lengths)
        return lengths

    def messages(self, session: int, answers: list[str]) -> list[dict[str, str]]:
        """The session's conversation up to its next turn, `answers` its answers so far."""
        messages = [{"role": "system", "content": system_prompt(self.system_tokens)}]
        for turn, length in enumerate(self.tool_lengths(session)[: len(answers) + 1]):
            messages.append({"role": "user", "content": tool_result(length, session, turn)})
            if turn < len(answers):
                messages.append({"role": "assistant", "content": answers[turn]})
        return messages


TRACES = {
    "agent": Trace(64, 8, 2048, (192, 192), 32),
    "coding": Trace(64, 16, 1024, (256, 512), 32),
}
#: --small: each trace's shape at a size the CPU engines serve in seconds.
SMALL_TRACES = {
    "agent": Trace(4, 3, 256, (64, 64), 4),
    "coding": Trace(8, 6, 128, (32, 64), 4),
}


class TraceTooLongError(ValueError):
    pass


def check_fits(trace: Trace, positions: int) -> None:
    """The longest session's last prompt, rendered by the byte-level models'
    chat template (one token a byte), plus its answer: within `positions`."""
    from jinja2 import Template

    from engines.tiny_model import CHAT_TEMPLATE

    template = Template(CHAT_TEMPLATE)
    answer = "x" * trace.answer_tokens  # an answer's most tokens in the history

    def last_turn(session: int) -> int:
        messages = trace.messages(session, [answer] * (trace.turns - 1))
        text = template.render(messages=messages, add_generation_prompt=True)
        return len(text.encode()) + trace.answer_tokens

    longest = max(range(trace.sessions), key=last_turn)
    need = last_turn(longest)
    if need > positions:
        raise TraceTooLongError(
            f"the trace does not fit the engines' max length: session {longest}'s last turn "
            f"needs {need} positions ({trace.system_tokens}-token system prompt, "
            f"{sum(trace.tool_lengths(longest))} tool tokens and {trace.answer_tokens} answer "
            f"tokens a turn over {trace.turns} turns, with the chat template's), the engines "
            f"have {positions}: raise --max-len (up to the model's positions) or shorten the "
            f"trace (--turns, --tool-tokens, --system-tokens, --answer-tokens)"
        )


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
    #: Per engine, what the router saw (`RoutedEngineStats`' fields).
    engines: list[dict]

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.seconds


def system_prompt(tokens: int) -> str:
    return "".join(f"Rule {i}: answer briefly and cite the tool's result. " for i in range(999))[
        :tokens
    ]


def tool_result(length: int, session: int, turn: int) -> str:
    """What the agent's tool returned: `length` bytes, the session's own."""
    rng = random.Random(session * 1009 + turn)
    text = f"Session {session}, tool call {turn} returned:"
    while len(text) < length:
        text += f" {rng.choice(WORDS)} {rng.randrange(1000)}"
    return text[:length]


async def replay_client(index: int, clients: int, payload, start) -> list[tuple[int, list]]:
    """One client process's sessions (every clients-th): (session, its turns' usage)."""
    import openai

    plain_url, urls, api_key, model, trace, ascii_answers = payload
    async with openai.AsyncOpenAI(base_url=plain_url, api_key=api_key, max_retries=0) as client:
        # Warm-up, outside any session: a tiny prompt, nothing the trace's prefixes hold.
        warm = [{"role": "user", "content": f"client {index}"}]
        await client.chat.completions.create(model=model, messages=warm, max_tokens=1)
    await start()

    async def session(i: int) -> tuple[int, list]:
        usage, answers = [], []
        async with openai.AsyncOpenAI(
            base_url=urls[i], api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
        ) as client:
            for _ in range(trace.turns):
                reply = await client.chat.completions.create(
                    model=model,
                    messages=trace.messages(i, answers),
                    max_tokens=trace.answer_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                answer = reply.choices[0].message.content or ""
                answers.append(
                    answer.encode("ascii", "replace").decode() if ascii_answers else answer
                )
                details = reply.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
                usage.append((reply.usage.prompt_tokens, cached, reply.usage.completion_tokens))
        return i, usage

    return list(await asyncio.gather(*(session(i) for i in range(index, trace.sessions, clients))))


def replay(router, routing: str, clients: int, args, served, tag: str) -> Replay:
    import ray

    trace = args.trace
    urls = [router.session_url(f"{tag}-{i}") for i in range(trace.sessions)]
    # Byte-level models (ours, not --model's): answers back as ASCII (module doc).
    payload = (f"{router.url}/v1", urls, served.api_key, served.model, trace, not args.model)
    run = in_clients(replay_client, clients, payload)
    engines = [e.model_dump() for e in router.stats().engines]  # sessions still placed
    for i in range(trace.sessions):  # the router forgets them
        ray.get(router.actor.take_trajectory.remote(f"{tag}-{i}"), timeout=60)
    usage = dict(s for client in run.results for s in client)
    turns = [usage[i] for i in range(trace.sessions)]
    flat = [t for session in turns for t in session]
    return Replay(
        routing,
        clients,
        run.seconds,
        len(flat),
        sum(t[0] for t in flat),
        sum(t[1] for t in flat),
        [[(t[0], t[2]) for t in session] for session in turns],
        engines,
    )


def uncached_model(
    lengths: list[list[tuple[int, int]]], shared: int, engines: int
) -> dict[str, float]:
    """Prompt tokens each routing leaves to prefill, by turn lengths (up to
    the cache's block rounding). Sticky: a session's engine holds all of it
    but the new turn (and the `shared` system prompt from the start). Round
    robin: a turn lands on any of the engines alike, which holds the session up to
    the last turn it served there (j turns back with probability
    (1/E)(1-1/E)^(j-1)), else the system prompt only."""
    miss = 1 - 1 / engines
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

    served = serve(args, args.engines, prefix_caching=True, name="agent-replay")
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
                    print_engines(result)
    finally:
        served.close()
    return runs


def print_engines(result: Replay) -> None:
    """Where the routing put the work: per engine, as the router saw it."""
    for e in result.engines:
        usage_hit = e["cached_prompt_tokens"] / e["prompt_tokens"] if e["prompt_tokens"] else 0.0
        engine_hit = (
            e["prefix_cache_hits"] / e["prefix_cache_queries"] if e["prefix_cache_queries"] else 0.0
        )
        print(
            f"{'':>14}{e['name']}: {e['requests']} requests, {e['sessions']} sessions, "
            f"cache hit {usage_hit:.3f} (engine's own count {engine_hit:.3f} of "
            f"{e['prefix_cache_queries']} tokens), peak KV use {e['peak_kv_cache_usage']:.2f}"
        )


def report(runs: list[Replay], args) -> dict:
    fanned = [r for r in runs if r.clients == args.clients]

    def median(value) -> dict[str, float]:
        return {r: statistics.median(value(x) for x in fanned if x.routing == r) for r in ROUTINGS}

    rate, hit = median(lambda x: x.turns_per_s), median(lambda x: x.hit_ratio)
    measured = median(lambda x: x.prompt_tokens - x.cached_tokens)
    single = {x.routing: x.turns_per_s for x in runs if x.clients == 1}
    model = uncached_model(fanned[0].lengths, args.trace.system_tokens, args.engines)
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


def trace_of(args) -> Trace:
    """--trace's preset (--small: its small size), with the settings given."""
    preset = (SMALL_TRACES if args.small else TRACES)[args.trace]
    tool = preset.tool_tokens
    if args.tool_tokens:
        low, _, high = args.tool_tokens.partition("-")
        tool = (int(low), int(high or low))
    trace = Trace(
        args.sessions or preset.sessions,
        args.turns or preset.turns,
        preset.system_tokens if args.system_tokens is None else args.system_tokens,
        tool,
        args.answer_tokens or preset.answer_tokens,
    )
    if min(trace.sessions, trace.turns, trace.answer_tokens, *tool) < 1 or tool[0] > tool[1]:
        raise SystemExit(f"a trace of positive sizes, tool tokens LO <= HI; got {trace}")
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser)
    parser.add_argument("--engines", type=int, default=2, help="engines behind the router")
    parser.add_argument("--trace", choices=sorted(TRACES), default="agent")
    parser.add_argument(
        "--sessions",
        type=int,
        help="default 64 (enough to keep one H200 busy; see the coding trace above)",
    )
    parser.add_argument("--turns", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--tool-tokens", help='a tool result\'s tokens: "N" or "LO-HI"')
    parser.add_argument("--answer-tokens", type=int)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.engines < 1:
        raise SystemExit(f"--engines must be at least 1, got {args.engines}")
    if args.small:
        args.repeats, args.max_len, args.clients = 1, args.max_len or 1024, 2
    args.trace = trace_of(args)
    try:
        check_fits(args.trace, max_len(args))
    except TraceTooLongError as exc:
        raise SystemExit(str(exc)) from None
    runs = run(args)
    figures = report(runs, args)
    if args.json:
        figures["trace"] = asdict(args.trace)
        figures["runs"] = [asdict(r) for r in runs]
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
