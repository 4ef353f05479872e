"""The OpenAI endpoint's throughput against direct actor calls, on the same
requests and the same engine, alternating. Not a test: it reports numbers.

    python3 benchmarks/openai_vs_actor.py [--clients 8] [--repeats 3] [--json out.json]  # GPU
    python3 benchmarks/openai_vs_actor.py --backend hf --small                           # CPU

The requests: --requests prompts of --prompt-len random byte tokens, each
asking --max-tokens tokens (temperature 1, seeded, ignore_eos), all sent at
once. Through the actor: one `generate.remote(prompt, params)` per request
from the driver; through the endpoint: one `/v1/completions` per request
(token-id prompt, `return_token_ids`) with the `openai` client, from one
process ("openai x1") and from --clients processes, each sending its share
("openai xN").

Why several client processes: the `openai` client costs milliseconds of CPU
a request (it walks a token-id prompt element by element to transform it, and
httpx's pool walks every open connection per request), all on one thread; with
hundreds of requests in one process that client, not the server, sets the
pace. Agent fleets drive an endpoint from many processes, so xN measures the
serving path as they use it; x1 is printed too, with each path's client CPU a
request. A Ray driver's `.remote()` is C++ and needs no such help.

A warm-up of each path, then --repeats timed runs of each, alternating.
Printed: output tokens/s per path (median), and openai xN / actor (target
>= 0.9). Prefix caching is off, so a repeated prompt costs the same each time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from endpoint_engines import add_engine_arguments, in_clients, serve  # noqa: E402

REQUEST_TIMEOUT_S = 600


def workload(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 259) for _ in range(args.prompt_len)] for _ in range(args.requests)]


async def through_actor(engine, prompts, args) -> int:
    from engines import SamplingParams

    async def one(i: int, prompt: list[int]) -> int:
        params = SamplingParams(
            temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=i
        )
        output = await engine.generate.remote(prompt, params)
        return len(output.outputs[0].token_ids)

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def through_endpoint(client, model: str, requests, args) -> int:
    """`requests`: (seed, prompt) pairs."""

    async def one(seed: int, prompt: list[int]) -> int:
        answer = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return len(answer.choices[0].token_ids)

    return sum(await asyncio.gather(*(one(seed, p) for seed, p in requests)))


async def endpoint_client(index: int, clients: int, payload, start) -> int:
    """One client process's share: every clients-th request."""
    import openai

    url, api_key, model, args = payload
    mine = [(i, p) for i, p in enumerate(workload(args)) if i % clients == index]
    async with openai.AsyncOpenAI(
        base_url=url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as client:
        await through_endpoint(client, model, mine[:1], args)  # warm-up
        await start()
        return await through_endpoint(client, model, mine, args)


async def compare(served, args) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Output tokens/s of each path per run, and each path's client CPU
    seconds a request (the last run's)."""
    import openai

    engine = served.engines[0]
    prompts = workload(args)
    fan_out = f"openai x{args.clients}"
    rates: dict[str, list[float]] = {"actor": [], "openai x1": [], fan_out: []}
    cpu: dict[str, float] = {}

    async def timed(name: str, run) -> tuple[int, float]:
        start, used = time.monotonic(), time.process_time()
        tokens = await run()
        cpu[name] = (time.process_time() - used) / len(prompts)
        return tokens, time.monotonic() - start

    async def clients() -> tuple[int, float]:
        payload = (served.urls[0], served.api_key, served.model, args)
        run = await asyncio.to_thread(in_clients, endpoint_client, args.clients, payload)
        cpu[fan_out] = run.cpu_seconds / len(prompts)
        return sum(run.results), run.seconds

    async with openai.AsyncOpenAI(
        base_url=served.urls[0], api_key=served.api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as client:
        single = list(enumerate(prompts))
        paths = {
            "actor": lambda: timed("actor", lambda: through_actor(engine, prompts, args)),
            "openai x1": lambda: timed(
                "openai x1", lambda: through_endpoint(client, served.model, single, args)
            ),
            fan_out: clients,
        }
        for path in paths.values():  # warm-up
            await path()
        for repeat in range(args.repeats):
            for name in list(paths) if repeat % 2 == 0 else list(paths)[::-1]:
                tokens, seconds = await paths[name]()
                rates[name].append(tokens / seconds)
                print(f"{name:>10}: {tokens} tokens in {seconds:6.2f}s ({tokens / seconds:8.0f}/s)")
    return rates, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.small:
        args.requests, args.prompt_len, args.max_tokens, args.repeats = 8, 16, 8, 2
        args.max_len, args.clients = 256, 2
    served = serve(args, 1, prefix_caching=False, name="openai-vs-actor")
    try:
        rates, cpu = asyncio.run(compare(served, args))
    finally:
        served.close()
    median = {name: statistics.median(values) for name, values in rates.items()}
    fan_out = f"openai x{args.clients}"
    ratio = median[fan_out] / median["actor"]
    print("client CPU a request: " + ", ".join(f"{n} {1e3 * c:.2f} ms" for n, c in cpu.items()))
    print(
        f"output tokens/s: actor {median['actor']:.0f}, openai x1 {median['openai x1']:.0f}, "
        f"{fan_out} {median[fan_out]:.0f}; {fan_out} / actor {ratio:.2f} (target >= 0.9), "
        f"openai x1 / actor {median['openai x1'] / median['actor']:.2f}"
    )
    if args.json:
        figures = {"rates": rates, "ratio": ratio, "client_cpu_s_per_request": cpu}
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
