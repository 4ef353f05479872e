"""Issue 31: an environment of a maintained RL-environment library that
speaks the OpenAI client runs against our endpoint unchanged. PrimeIntellect's
`verifiers` (v0.4, `verifiers.v1`) runs an episode of its own `SingleAgentEnv`
with its `EvalClient` pointed at the run's router (`EvalClientConfig`: the
router's /v1 and the bearer token's variable), on a real CPU engine. Its
client sends each rollout's trace id as `X-Session-ID`, so the router
records the rollout as that session: the test reads the tokens back from it.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
import verifiers.v1 as vf
from transformers import AutoTokenizer
from verifiers.v1.runtimes import SubprocessConfig
from verifiers_tasks import ChatHarnessConfig, letter_fraction

from agents.router.actor import start_router
from engines import EngineSetSpec, destroy_engines, start_engine_set

pytestmark = pytest.mark.slow

KEY_VAR = "ROLLOUTFLOW_TEST_VERIFIERS_KEY"
READY_S = 240


@pytest.fixture(scope="module")
def served(ray_local_module, tiny_model):
    """One CPU engine serving the OpenAI API, and the router in front of it."""
    spec = EngineSetSpec(
        pretrain=tiny_model, num_engines=1, max_len=1024, name_prefix="vf", openai_api=True
    )
    engines = start_engine_set(spec)
    router = None
    try:
        router = start_router(list(engines), spec.api_key, start_timeout_s=READY_S)
        yield engines, router, spec.api_key
    finally:
        if router is not None:
            router.close()
        destroy_engines(engines)


def run_episode(config: vf.SingleAgentEnvConfig, task_index: int, ctx: vf.ModelContext):
    """One episode as verifiers' in-process eval runs it: the env's serving
    resources (its interception server) up, then `run_episode`."""
    env = vf.load_environment(config)

    async def episode() -> vf.Episode:
        async with env.serving():
            return await env.run_episode(list(env.taskset)[task_index], ctx)

    return asyncio.run(episode())


@pytest.mark.parametrize("turns", [1, 2], ids=["single-turn", "multi-turn"])
def test_a_verifiers_env_runs_a_rollout_through_the_router(served, tiny_model, monkeypatch, turns):
    engines, router, api_key = served
    monkeypatch.setenv(KEY_VAR, api_key)
    config = vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id="verifiers_tasks"),
        agent=vf.AgentConfig(
            harness=ChatHarnessConfig(id="verifiers_tasks", turns=turns),
            runtime=SubprocessConfig(),
        ),
    )
    client = vf.EvalClientConfig(base_url=f"{router.url}/v1", api_key_var=KEY_VAR)
    episode = run_episode(config, turns - 1, vf.ModelContext(tiny_model, client))

    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert trace.ok and trace.num_turns == turns, trace.errors
    # The router recorded the rollout under verifiers' session id: every
    # reply verifiers saw is the text of tokens our engine sampled.
    samples = ray.get(router.actor.take_trajectory.remote(trace.id), timeout=30)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    replies = []
    for sample in samples:
        for span in sample.turns:
            if span.role == "assistant":
                assert span.engine == engines.names[0]
                assert sample.token_versions[span.start : span.stop] == [0] * (
                    span.stop - span.start
                )
                ids = sample.response_token_ids[span.start : span.stop]
                replies.append(tokenizer.decode(ids, skip_special_tokens=True))
    assert replies == [message.content for message in trace.assistant_messages]
    # The env's reward function scored our engine's last reply.
    assert trace.rewards["letter"].score == letter_fraction(replies[-1], trace.task.data.label)
    assert router.stats().open_sessions == 0
