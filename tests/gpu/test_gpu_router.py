"""The session router in front of two vLLM engines (vLLM's own serving code
in each engine): a replay of agent sessions sharing a long system prompt,
sticky routing against round robin on the same trace. Prints the prefix-cache
hit ratio (cached / prompt tokens, from the engines' usage) and the wall
time of each; the sticky run's ratio must reach 0.85."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from gpu_helpers import wait_gpus_released, wait_ready

from agents.router.actor import start_router
from engines import create_vllm_engines, destroy_engines

pytestmark = pytest.mark.gpu

SESSIONS, TURNS, ANSWER_TOKENS = 64, 8, 32
# ~2k tokens with the tiny model's byte-level tokenizer (one token a byte)
SYSTEM = "".join(f"Rule {i}: answer briefly and cite the tool's result. " for i in range(40))[:2048]


async def replay(router, key: str, model: str, tag: str) -> tuple[float, int]:
    """Every session's turns in order, the sessions concurrently; returns the
    wall time and the sampled tokens recorded in the sessions' trajectories."""

    async def session(i: int) -> None:
        url = router.session_url(f"{tag}-{i}")
        async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
            messages = [{"role": "system", "content": SYSTEM}]
            for k in range(TURNS):
                messages.append({"role": "user", "content": f"Session {i}, question {k}?"})
                reply = await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=ANSWER_TOKENS,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})

    start = time.monotonic()
    await asyncio.gather(*(session(i) for i in range(SESSIONS)))
    seconds = time.monotonic() - start
    sampled = 0
    for i in range(SESSIONS):
        samples = await router.actor.take_trajectory.remote(f"{tag}-{i}")
        sampled += sum(len(s.sampled_token_ids) for s in samples)
    return seconds, sampled


def test_sticky_sessions_hit_the_prefix_cache(ray_gpu, gpu_model, gpu_count, gpu_baseline):
    ray = ray_gpu
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = None
    if gpu_count < 2:  # two engines share the one GPU
        pg = placement_group([{"GPU": 0.5, "CPU": 1}] * 2, strategy="PACK")
        ray.get(pg.ready(), timeout=60)
    engines = create_vllm_engines(
        num_engines=2,
        pretrain=gpu_model,
        max_len=4096,
        gpu_memory_utilization=0.3 if pg else 0.6,
        tensor_parallel_size=1,
        enable_prefix_caching=True,
        backend="vllm",
        name_prefix="gpu-router",
        shared_pg=pg,
        openai_api=True,
    )
    figures = {}
    try:
        wait_ready(engines, "2 engines for the router")
        for routing in ("sticky", "round_robin"):
            ray.get([e.reset_prefix_cache.remote() for e in engines], timeout=60)
            router = start_router(list(engines), engines.api_key, routing)
            try:
                seconds, sampled = asyncio.run(replay(router, engines.api_key, gpu_model, routing))
                stats = router.stats()
            finally:
                router.close()
            figures[routing] = (seconds, stats.cache_hit_ratio)
            print(
                f"\n{routing}: {SESSIONS} sessions x {TURNS} turns in {seconds:.1f}s, "
                f"cache hit {stats.cache_hit_ratio:.3f} (engines' own count "
                f"{stats.engine_hit_ratio:.3f}), "
                f"requests per engine {[e.requests for e in stats.engines]}, "
                f"peak KV use {[e.peak_kv_cache_usage for e in stats.engines]}"
            )
            # vLLM's scheduler stats reach the router (its counts print above)
            assert all(e.prefix_cache_queries > 0 for e in stats.engines)
            assert sampled == SESSIONS * TURNS * ANSWER_TOKENS
            assert stats.open_sessions == 0
        speedup = figures["round_robin"][0] / figures["sticky"][0]
        print(f"sticky over round robin: {speedup:.2f}x throughput")
        assert figures["sticky"][1] >= 0.85
    finally:
        destroy_engines(engines)
        if pg is not None:
            remove_placement_group(pg)
        wait_gpus_released(gpu_baseline)
