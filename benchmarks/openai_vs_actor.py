"""The OpenAI endpoint's throughput against direct actor calls, on the same
requests and the same engine, alternating. Not a test: it reports numbers.

    python3 benchmarks/openai_vs_actor.py [--repeats 3] [--json out.json]   # GPU: one vLLM engine
    python3 benchmarks/openai_vs_actor.py --backend hf --small               # CPU, small scale

The requests: --requests prompts of --prompt-len random byte tokens, each
asking --max-tokens tokens (temperature 1, seeded, ignore_eos), all sent at
once. Through the actor: one `generate.remote(prompt, params)` per request;
through the endpoint: one `/v1/completions` per request (token-id prompt,
`return_token_ids`) with the `openai` client. A warm-up of each path, then
--repeats timed runs of each, alternating. Printed: output tokens/s per path
(median), and endpoint / actor (target >= 0.9). Prefix caching is off, so a
repeated prompt costs the same each time.
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

from endpoint_engines import add_engine_arguments, serve  # noqa: E402 - after the path

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


async def through_endpoint(client, model: str, prompts, args) -> int:
    async def one(i: int, prompt: list[int]) -> int:
        answer = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=i,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return len(answer.choices[0].token_ids)

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def compare(served, args) -> dict[str, list[float]]:
    import openai

    engine = served.engines[0]
    prompts = workload(args)
    rates: dict[str, list[float]] = {"actor": [], "openai": []}
    async with openai.AsyncOpenAI(
        base_url=served.urls[0], api_key=served.api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as client:
        paths = {
            "actor": lambda: through_actor(engine, prompts, args),
            "openai": lambda: through_endpoint(client, served.model, prompts, args),
        }
        for path in paths.values():  # warm-up
            await path()
        for repeat in range(args.repeats):
            for name in ("actor", "openai") if repeat % 2 == 0 else ("openai", "actor"):
                start = time.monotonic()
                tokens = await paths[name]()
                seconds = time.monotonic() - start
                rates[name].append(tokens / seconds)
                print(f"{name:>6}: {tokens} tokens in {seconds:6.2f}s ({tokens / seconds:8.0f}/s)")
    return rates


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
        args.max_len = 256
    served = serve(args, 1, prefix_caching=False, name="openai-vs-actor")
    try:
        rates = asyncio.run(compare(served, args))
    finally:
        served.close()
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median["openai"] / median["actor"]
    print(
        f"output tokens/s: actor {median['actor']:.0f}, openai {median['openai']:.0f}; "
        f"openai / actor {ratio:.2f} (target >= 0.9)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
