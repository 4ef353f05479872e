"""The router end to end: real Ray, real CPU engines serving their OpenAI
endpoints, the real `openai` client. A 5-turn tool session for three chat
templates (the tiny model's own, Qwen2.5's ChatML with tools, Qwen3's, which
is not append-only), an engine killed mid-session, sticky and least-loaded
placement read from `stats()`.

The engines serve a tiny random model whose vocabulary is printable ASCII,
newline and one special token, `<|im_end|>` (its EOS): every sampled id
decodes to text that re-tokenizes to the same id, so a split here comes from
the template alone, never from a lossy decode of random bytes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
import ray
from waiting import wait_until

from agents.router.actor import start_router
from engines import EngineSetSpec, destroy_engines, start_engine_set
from engines.tiny_model import CHAT_TEMPLATE

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parent / "chat_templates"
EOS = "<|im_end|>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]
READY_S = 240
#: What Qwen3's generation prompt ends with when thinking is off (one id per character).
EMPTY_THINK = "<think>\n\n</think>\n\n"


def text(ids) -> str:
    """The printable model's ids as text (id 0 is EOS, 1 newline, then bytes 32..126)."""
    return "".join(EOS if t == 0 else "\n" if t == 1 else chr(t + 30) for t in ids)


def gpt2_byte_symbols() -> dict[int, str]:
    """The byte-level pre-tokenizer's symbol of each byte (GPT-2's table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, extra = dict(zip(printable, map(chr, printable), strict=True)), 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def build_printable_model(path: Path, chat_template: str) -> str:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    symbols = gpt2_byte_symbols()
    vocab = {EOS: 0} | {symbols[b]: i + 1 for i, b in enumerate([10, *range(32, 127)])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert tokenizer.encode(f"a\n{EOS}b", add_special_tokens=False) == [67, 1, 0, 68]
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("router-models")
    texts = {
        "tiny": CHAT_TEMPLATE,
        "qwen2.5": (TEMPLATES / "qwen2_5.jinja").read_text(),
        "qwen3": (TEMPLATES / "qwen3.jinja").read_text(),
    }
    return {name: build_printable_model(root / name, text) for name, text in texts.items()}


def engine_set(model: str, prefix: str, num_engines: int = 1, key: str | None = None):
    spec = EngineSetSpec(
        pretrain=model,
        num_engines=num_engines,
        max_len=4096,
        name_prefix=prefix,
        openai_api=True,
        openai_api_key=key,
    )
    return start_engine_set(spec), spec.api_key


@pytest.fixture(scope="module")
def template_routers(ray_local_module, models):
    """One engine and its router per template (the three start together)."""
    sets = {
        name: engine_set(model, f"rt-{name.replace('.', '')}") for name, model in models.items()
    }
    routers = {}
    try:
        for name, (engines, key) in sets.items():
            routers[name] = (start_router(list(engines), key, start_timeout_s=READY_S), key)
        yield routers
    finally:
        for router, _ in routers.values():
            router.close()
        for engines, _ in sets.values():
            destroy_engines(engines)


class ToolAgent:
    """An agent's loop against its session: a question, then each answer
    followed by a tool result (the environment). `seen`: what the client saw
    of each turn."""

    def __init__(self, router, key, session, model, **extra):
        self.url, self.key = router.session_url(session), key
        self.model, self.extra = model, extra
        self.messages = [
            {"role": "system", "content": "Answer with the tool's help."},
            {"role": "user", "content": "What does 'ray' mean?"},
        ]
        self.seen = []

    async def turn(self) -> None:
        # a client per turn: each test step runs in its own event loop
        async with openai.AsyncOpenAI(base_url=self.url, api_key=self.key, max_retries=0) as client:
            reply = await client.chat.completions.create(
                model=self.model,
                messages=self.messages,
                tools=TOOLS,
                tool_choice="none",
                max_tokens=6,
                temperature=1.0,
                **self.extra,
            )
        choice = reply.choices[0]
        self.seen.append(
            {
                "prompt": reply.model_extra["prompt_token_ids"],
                "ids": choice.model_extra["token_ids"],
                "logprobs": [c.logprob for c in choice.logprobs.content],
            }
        )
        k = len(self.seen)
        result = json.dumps({"word": "ray", "meaning": f"beam {k}"})
        self.messages.append({"role": "assistant", "content": choice.message.content})
        self.messages.append({"role": "tool", "tool_call_id": f"call-{k}", "content": result})


async def tool_session(router, key, session, model, turns=5, **extra):
    agent = ToolAgent(router, key, session, model, **extra)
    for _ in range(turns):
        await agent.turn()
    return agent.seen


def check_exact(samples, seen):
    """Every sample is its turns' exact ids: the first prompt, then for each
    turn the prompt's new ids (mask 0) and the sampled ids (mask 1); a new
    sample starts exactly where a prompt leaves the stream."""
    turn = 0
    for sample in samples:
        stream = list(sample.prompt_token_ids)
        assert stream == seen[turn]["prompt"]
        sampled, logprobs = [], []
        first = True
        while turn < len(seen):
            prompt = seen[turn]["prompt"]
            if not first and prompt[: len(stream)] != stream:
                break  # the next sample starts here
            stream = prompt + seen[turn]["ids"]
            sampled += seen[turn]["ids"]
            logprobs += seen[turn]["logprobs"]
            first = False
            turn += 1
        assert sample.prompt_token_ids + sample.response_token_ids == stream
        assert sample.sampled_token_ids == sampled
        assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m] == (
            pytest.approx(logprobs)
        )
        for span in sample.turns:
            mask = sample.loss_mask[span.start : span.stop]
            assert set(mask) <= {1 if span.role == "assistant" else 0}
    assert turn == len(seen)


@pytest.mark.parametrize(
    ("template", "extra", "expected_samples"),
    [
        # ignore_eos: the tiny template renders no EOS after an answer, so a
        # sampled EOS would (rightly) split the trajectory
        ("tiny", {"extra_body": {"ignore_eos": True}}, 1),
        ("qwen2.5", {}, 1),
        # Qwen3 without thinking: every generation prompt ends with an empty
        # think block that the next turn's rendering of history drops
        ("qwen3", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, 5),
    ],
)
def test_a_tool_session_trains_on_the_exact_ids_or_splits(
    template_routers, models, template, extra, expected_samples
):
    router, key = template_routers[template]
    seen = asyncio.run(tool_session(router, key, f"s-{template}", models[template], **extra))
    samples = ray.get(router.actor.take_trajectory.remote(f"s-{template}"), timeout=30)
    assert len(samples) == expected_samples
    check_exact(samples, seen)
    assert all(
        v == 0 for s in samples for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m
    )
    first = samples[0]
    environment = text(
        t
        for span in first.turns
        if span.role == "environment"
        for t in first.response_token_ids[span.start : span.stop]
    )
    if expected_samples == 1:
        assert environment.count('"meaning": "beam') == 4  # the tool results are environment
    for k, sample in enumerate(samples[1:], start=2):
        # the stream had "<think>..." where the prompt has the answer's text
        reason = sample.split_reason
        assert reason.startswith(f"turn {k}: its prompt leaves the token stream at position")
        previous = seen[k - 2]["prompt"]
        assert f"position {len(previous) - len(EMPTY_THINK)}:" in reason
        assert "the stream has 30 '<'" in reason
    assert router.stats().open_sessions == 0


def test_a_token_in_token_out_session_is_one_exact_sample(template_routers, models):
    router, key = template_routers["tiny"]
    base = router.session_url("tokens")

    async def go() -> list[int]:
        ids = [67, 68, 69]
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
            for k in range(3):
                reply = await client.completions.create(
                    model=models["tiny"], prompt=ids, max_tokens=4, extra_body={"ignore_eos": True}
                )
                ids = ids + reply.choices[0].model_extra["token_ids"] + [1, 2 + k]
        return ids[:-2]  # the last environment ids were never sent

    stream = asyncio.run(go())
    [sample] = ray.get(router.actor.take_trajectory.remote("tokens"), timeout=30)
    assert sample.prompt_token_ids == [67, 68, 69]
    assert sample.prompt_token_ids + sample.response_token_ids == stream
    assert sample.loss_mask == [1] * 4 + [0, 0] + [1] * 4 + [0, 0] + [1] * 4
    assert [t.role for t in sample.turns] == ["assistant", "environment"] * 2 + ["assistant"]
    assert all(lp < 0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m)


@pytest.fixture
def pair(ray_local, models):
    """Two engines behind a router, and a third with the same token, not yet routed to."""
    engines, key = engine_set(models["qwen2.5"], "rt-pair", num_engines=2)
    replacement, _ = engine_set(models["qwen2.5"], "rt-replacement", key=key)
    router = None
    try:
        router = start_router(list(engines), key, start_timeout_s=READY_S)
        yield engines, key, router, replacement
    finally:
        if router is not None:
            router.close()
        destroy_engines(engines)
        destroy_engines(replacement)


def killed(engine) -> None:
    ray.kill(engine, no_restart=True)

    def dead() -> bool:
        try:
            ray.get(engine.health.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_until(dead, 60, "the killed engine's actor to be dead")


def test_sticky_least_loaded_then_an_engine_killed_mid_session(pair, models):
    engines, key, router, replacement = pair
    e0, e1 = engines.names
    agents = {s: ToolAgent(router, key, s, models["qwen2.5"]) for s in "abc"}

    async def turns(*sessions):
        for session in sessions:  # one after another: placement is deterministic
            await agents[session].turn()

    asyncio.run(turns("a", "b", "c"))
    stats = router.stats()
    # new sessions: fewest in flight (none), then fewest sessions held
    assert {e.name: (e.sessions, e.requests) for e in stats.engines} == {e0: (2, 2), e1: (1, 1)}
    asyncio.run(turns("a", "b", "c"))
    stats = router.stats()  # sticky: each session's second turn on its engine
    assert {e.name: (e.sessions, e.requests) for e in stats.engines} == {e0: (2, 4), e1: (1, 2)}
    assert all(e.prompt_tokens > 0 and e.in_flight == 0 for e in stats.engines)
    # the engines' own reports: the CPU engine has no prefix cache, every
    # prompt token it computed (each the router sent) is a lookup, none a hit
    for e in stats.engines:
        assert (e.prefix_cache_queries, e.prefix_cache_hits) == (e.prompt_tokens, 0), e
        assert (e.running, e.waiting, e.kv_cache_usage) == (0, 0, 0.0)

    killed(engines[0])
    asyncio.run(turns("a"))  # a's engine is gone: the turn runs on e1, a moves there
    stats = router.stats()
    by_name = {e.name: e for e in stats.engines}
    assert not by_name[e0].alive and by_name[e0].failures == 1
    # a moved to e1; c moves on its next request
    assert (by_name[e1].sessions, by_name[e1].requests) == (2, 3)
    assert by_name[e0].sessions == 1
    [sample] = ray.get(router.actor.take_trajectory.remote("a"), timeout=30)
    assert [t.engine for t in sample.turns if t.role == "assistant"] == [e0, e0, e1]
    check_exact([sample], agents["a"].seen)

    killed(engines[1])
    with pytest.raises(openai.InternalServerError) as caught:
        asyncio.run(turns("b"))
    assert caught.value.status_code == 503
    message = caught.value.body["message"]
    # (ConnectError, or ReadError on a pooled connection the dying engine dropped)
    assert "session 'b'" in message and f"failed: {e1} (" in message
    assert "no live engine left" in message
    # the failed turn is not recorded; a replacement engine added to the router
    # takes b's next turn, which continues b's token history
    added = ray.get(router.actor.add_engine.remote(replacement[0]), timeout=READY_S)
    asyncio.run(turns("b"))
    [sample] = ray.get(router.actor.take_trajectory.remote("b"), timeout=30)
    assert [t.engine for t in sample.turns if t.role == "assistant"] == [e1, e1, added]
    check_exact([sample], agents["b"].seen)
    # the run's replacement done: the router routes to exactly the run's engines
    # now, the replaced ones forgotten; c, held by the dead e0, moves on its turn
    routed = ray.get(router.actor.set_engines.remote([replacement[0]]), timeout=READY_S)
    assert routed == [added] == [e.name for e in router.stats().engines]
    asyncio.run(turns("c"))
    [sample] = ray.get(router.actor.take_trajectory.remote("c"), timeout=30)
    assert [t.engine for t in sample.turns if t.role == "assistant"] == [e0, e0, added]
    assert router.stats().open_sessions == 0
