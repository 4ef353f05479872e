"""The CPU backend's sampling, in process (no Ray): every SamplingParams field
is honoured, and logprobs agree with the model run without batching or cache."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
import torch
from fresh_imports import imported_with
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.config import EngineConfig
from engines.errors import EngineSleepingError, RequestError
from engines.hf import HFEngine
from engines.load import EngineLoad
from engines.sampling import SamplingParams
from engines.startup import warn_vocab_mismatch

PROMPT = [42, 71, 78, 78, 81, 14]
LONG_PROMPT = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]


def make_engine(model_dir: str, seed: int = 0) -> HFEngine:
    config = EngineConfig(
        name="unit",
        pretrain=model_dir,
        max_len=64,
        seed=seed,
        gpu_memory_utilization=0.5,
        rpc_timeout_s=30,
    )
    return HFEngine(config)


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = make_engine(tiny_model)
    yield engine
    run(engine.shutdown())


@pytest.fixture(scope="module")
def reference(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def logprobs(tokens: list[int]) -> torch.Tensor:
        """log p(token t | tokens < t) for t >= 1, from one plain forward pass."""
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]

    return logprobs


def tokens(engine, prompt, **params) -> list[list[int]]:
    output = run(engine.generate(prompt, SamplingParams(**params)))
    return [c.token_ids for c in output.outputs]


def test_greedy_is_deterministic_and_matches_top_k_1_and_tiny_top_p(engine):
    greedy = tokens(engine, PROMPT, temperature=0.0, max_tokens=10, ignore_eos=True)
    assert greedy == tokens(engine, PROMPT, temperature=0.0, max_tokens=10, ignore_eos=True)
    assert greedy == tokens(engine, PROMPT, top_k=1, max_tokens=10, ignore_eos=True, seed=1)
    assert greedy == tokens(engine, PROMPT, top_p=1e-6, max_tokens=10, ignore_eos=True, seed=2)


def test_load_counts_sequences_and_the_cache_the_batch_holds(engine):
    async def during_and_after():
        deadline = time.monotonic() + 60
        # The module's engine idle first: an earlier test's work would count.
        while busy(await engine.load()) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        before = await engine.load()
        params = SamplingParams(n=3, max_tokens=50, ignore_eos=True, seed=1)
        call = asyncio.ensure_future(engine.generate([PROMPT, LONG_PROMPT], params))
        seen = await engine.load()
        # Past the prefill: the batch holds its keys and values.
        while not seen.kv_cache_usage and not call.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # polls the engine's thread, orders nothing
            seen = await engine.load()
        await call
        # The thread answers the call, then clears its batch.
        after = await engine.load()
        while after.running and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            after = await engine.load()
        return before, seen, after

    before, seen, after = run(during_and_after())
    assert (seen.running, seen.waiting) == (6, 0), seen
    # Six padded rows of at least the longer prompt, of 64 rows x max_len 64.
    assert 6 * len(LONG_PROMPT) / (64 * 64) <= seen.kv_cache_usage <= 6 * 64 / (64 * 64)
    assert not busy(after)
    # No prefix cache: each of the six sequences' prompt tokens looked up, none found.
    looked_up = after.prefix_cache_queries - before.prefix_cache_queries
    assert looked_up == 3 * (len(PROMPT) + len(LONG_PROMPT))
    assert after.prefix_cache_hits == before.prefix_cache_hits == 0


def busy(load: EngineLoad) -> bool:
    return (load.running, load.waiting, load.kv_cache_usage) != (0, 0, 0.0)


def test_seed_n_and_max_tokens(engine):
    a = tokens(engine, PROMPT, n=3, seed=5, max_tokens=7, ignore_eos=True)
    assert a == tokens(engine, PROMPT, n=3, seed=5, max_tokens=7, ignore_eos=True)
    assert a != tokens(engine, PROMPT, n=3, seed=6, max_tokens=7, ignore_eos=True)
    assert len(a) == 3 and all(len(t) == 7 for t in a)
    assert len({tuple(t) for t in a}) == 3  # the n samples differ from each other


def test_top_k_restricts_to_the_k_most_likely(engine, reference):
    output = run(
        engine.generate(
            PROMPT, SamplingParams(top_k=3, logprobs=3, max_tokens=20, seed=3, ignore_eos=True)
        )
    )
    for entry, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids, strict=True):
        top3 = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert token in {t for t, _ in top3}


def test_stop_token_ids_and_min_tokens(engine):
    first = tokens(engine, PROMPT, temperature=0.0, max_tokens=1)[0][0]
    output = run(
        engine.generate(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[first])
        )
    )
    assert output.outputs[0].token_ids == [first]
    assert output.outputs[0].finish_reason == "stop"
    output = run(
        engine.generate(
            PROMPT,
            SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[first], min_tokens=4),
        )
    )
    assert first not in output.outputs[0].token_ids[:4]
    assert len(output.outputs[0].token_ids) >= 4


def test_eos_stops_unless_ignored(tiny_model, tmp_path, engine):
    # A copy of the model whose EOS is the token greedy decoding emits first.
    first = tokens(engine, PROMPT, temperature=0.0, max_tokens=1)[0][0]
    model_dir = tmp_path / "eos-model"
    shutil.copytree(tiny_model, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = first
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    eos_engine = make_engine(str(model_dir))
    try:
        out = run(eos_engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8)))
        assert out.outputs[0].token_ids == [first] and out.outputs[0].finish_reason == "stop"
        out = run(
            eos_engine.generate(
                PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            )
        )
        assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    finally:
        run(eos_engine.shutdown())


def test_logprobs_match_a_plain_forward_pass(engine, reference):
    """Sampled-token and prompt logprobs equal the model's, batched with a
    longer prompt (left padding) and decoded with the KV cache."""
    params = SamplingParams(max_tokens=12, seed=11, logprobs=2, prompt_logprobs=0, ignore_eos=True)
    short, _ = run(engine.generate([PROMPT, LONG_PROMPT], params))
    completion = short.outputs[0]
    full = PROMPT + completion.token_ids
    expected = reference(full)
    got_prompt = [
        entry[t].logprob for entry, t in zip(short.prompt_logprobs[1:], PROMPT[1:], strict=True)
    ]
    got_sampled = [
        entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    assert short.prompt_logprobs[0] is None
    torch.testing.assert_close(
        torch.tensor(got_prompt + got_sampled), expected, atol=1e-4, rtol=1e-4
    )
    assert completion.cumulative_logprob == pytest.approx(sum(got_sampled), abs=1e-3)
    assert all(1 <= len(entry) <= 3 for entry in completion.logprobs)


def test_batching_does_not_change_greedy_output(engine):
    alone = tokens(engine, PROMPT, temperature=0.0, max_tokens=10, ignore_eos=True)
    batched, _ = run(
        engine.generate(
            [PROMPT, LONG_PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        )
    )
    assert [c.token_ids for c in batched.outputs] == alone


def test_max_len_caps_generation(engine):
    prompt = list(range(10, 70))  # 60 tokens, max_len 64: room for 4
    out = run(engine.generate(prompt, SamplingParams(max_tokens=50, ignore_eos=True)))
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_bad_requests_are_rejected_and_engine_keeps_serving(engine):
    with pytest.raises(RequestError, match="outside"):
        run(engine.generate([1, 2, 100000], SamplingParams()))
    with pytest.raises(RequestError, match="non-empty list"):
        run(engine.generate([], SamplingParams()))
    # An empty text has no token to generate from (before it was refused,
    # it reached the model's forward and failed there).
    with pytest.raises(RequestError, match="prompt 0 is empty"):
        run(engine.generate_text("", SamplingParams()))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    assert tokens(engine, PROMPT, max_tokens=2, ignore_eos=True)


def test_sleep_refuses_work_until_woken(engine):
    run(engine.sleep(level=1))
    with pytest.raises(EngineSleepingError, match="asleep"):
        run(engine.generate(PROMPT, SamplingParams()))
    run(engine.wake_up(tags=["weights"]))
    with pytest.raises(EngineSleepingError, match="kv_cache"):
        run(engine.generate(PROMPT, SamplingParams()))
    run(engine.wake_up(tags=["kv_cache"]))
    assert tokens(engine, PROMPT, max_tokens=2)


def test_vllm_sampling_params_are_accepted_by_field_name():
    class VllmLike:  # what vllm.SamplingParams looks like to us
        n, temperature, top_p, top_k, max_tokens, min_tokens = 2, 0.7, 0.9, 0, 5, 1
        seed, stop_token_ids, ignore_eos, logprobs, prompt_logprobs = 3, None, True, 1, None

    params = SamplingParams.coerce(VllmLike())
    assert (params.n, params.top_k, params.stop_token_ids, params.logprobs) == (2, 0, [], 1)


def test_output_shape_is_vllms(engine, reference):
    """One prompt (token ids or a TokensPrompt dict) gives one RequestOutput, a
    list a list; logprobs are objects with `.logprob`, `.rank`, `.decoded_token`."""
    params = SamplingParams(max_tokens=4, seed=1, logprobs=2, ignore_eos=True)
    one = run(engine.generate(PROMPT, params))
    assert (
        one.outputs[0].token_ids
        == run(engine.generate({"prompt_token_ids": PROMPT}, params)).outputs[0].token_ids
    )
    assert [o.prompt_token_ids for o in run(engine.generate([PROMPT, LONG_PROMPT], params))] == [
        PROMPT,
        LONG_PROMPT,
    ]
    (listed,) = run(engine.generate([{"prompt_token_ids": PROMPT}], params))
    assert listed.prompt_token_ids == PROMPT
    completion = one.outputs[0]
    for position, token in zip(completion.logprobs, completion.token_ids, strict=True):
        by_rank = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in by_rank] == sorted(
            (lp.logprob for lp in by_rank), reverse=True
        )
        assert by_rank[0].rank == 1 and position[token].rank >= 1
        assert position[token].decoded_token == engine.tokenizer.decode([token])
    assert one.weight_versions == [one.weight_version] == [0]
    text = run(engine.generate_text("hello", params))
    assert text.prompt == "hello" and text.prompt_token_ids == engine.encode("hello")
    with pytest.raises(RequestError, match="multi_modal_data"):
        run(engine.generate(PROMPT, params, multi_modal_data={"image": [object()]}))
    assert run(engine.generate(PROMPT, params, multi_modal_data=None)).outputs


def test_pause_keep_freezes_a_request_across_a_sync_and_resumes_it(tiny_model, tmp_path):
    """pause_generation() (keep) returns within 1 s with a request in flight;
    a weight sync runs under the frozen request; after resume_generation()
    it continues on the new weights, and its output names both versions."""
    from engines.weight_sync.transports import checkpoint

    engine = make_engine(tiny_model)
    new_weights = {
        name: tensor * 1.5 if "lm_head" in name or "embed" in name else tensor
        for name, tensor in engine.worker.model.state_dict().items()
    }
    path = checkpoint.save(new_weights.items(), tmp_path / "v1", version=1)
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    old = tokens(engine, PROMPT, **greedy)[0]

    async def scenario():
        # The previous call's batch may still be closing (its answer is sent
        # before the thread clears `running`): wait until it has, so that
        # `running` below is this request's batch.
        deadline = time.monotonic() + 30
        while engine._loop.running:
            assert time.monotonic() < deadline, "the previous batch never closed"
            await asyncio.sleep(0.01)
        # Hold the model: the generation thread stops at its first forward
        # pass, so the pause surely finds the request in flight.
        engine._model_lock.acquire()
        request = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(**greedy)))
        while not engine._loop.running:  # the thread took it into a batch
            await asyncio.sleep(0.01)
        pausing = asyncio.ensure_future(engine.pause_generation())
        engine._model_lock.release()
        started = time.monotonic()
        await asyncio.wait_for(pausing, 1.0)
        pause_s = time.monotonic() - started
        assert not request.done() and engine._admission.closed
        await engine.load_checkpoint(str(path), version=1)  # begin, load, finish
        assert not request.done(), "the sync's own resume let the request go"
        await engine.resume_generation()
        return pause_s, await asyncio.wait_for(request, 60)

    try:
        pause_s, output = run(scenario())
        new = [tokens(engine, PROMPT + old[:k], **greedy)[0] for k in range(1, 24)]
    finally:
        run(engine.shutdown())
    assert pause_s < 1.0
    assert (output.weight_version, output.weight_versions) == (0, [0, 1])
    got = output.outputs[0].token_ids
    assert got != old
    # A prefix came from the old weights, the rest from the new ones.
    assert any(got == old[:k] + new[k - 1][: 24 - k] for k in range(1, 24))


def test_stop_strings_cut_the_text_as_vllm_does(engine):
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = run(engine.generate(PROMPT, SamplingParams(**greedy))).outputs[0]
    stop = engine.tokenizer.decode(free.token_ids[4:6])
    assert stop.strip() and stop in free.text
    cut = run(engine.generate(PROMPT, SamplingParams(stop=[stop, "\x00never"], **greedy)))
    sample = cut.outputs[0]
    start = free.text.find(stop)
    assert (sample.finish_reason, sample.stop_reason) == ("stop", stop)
    assert sample.text == free.text[:start]
    assert free.token_ids[: len(sample.token_ids)] == sample.token_ids
    kept = run(
        engine.generate(
            PROMPT, SamplingParams(stop=stop, include_stop_str_in_output=True, **greedy)
        )
    ).outputs[0]
    assert kept.text == free.text[: start + len(stop)]


def test_unbounded_max_tokens_and_unknown_fields(engine):
    out = run(engine.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True)))
    assert len(out.outputs[0].token_ids) == 64 - len(PROMPT)  # up to max_len
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["x"])
    params = SamplingParams()
    params.max_tokens = 0  # assignable, as vLLM's; checked by the request
    with pytest.raises(RequestError, match="max_tokens must be at least 1"):
        run(engine.generate(PROMPT, params))
    with pytest.raises(RequestError, match="max_logprobs=20"):
        run(engine.generate(PROMPT, SamplingParams(logprobs=21)))


def vocab_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "vocab_size" in r.getMessage()]


@pytest.mark.parametrize(
    ("tokenizer_size", "vocab", "rows", "warned"),
    [
        (259, 320, 320, False),  # the tiny model: 259 tokens padded to a multiple of 64
        (259, 320, 384, False),  # ... and vLLM's rows, padded again
        (151665, 151936, 151936, False),  # Qwen2.5's checkpoints ship padded
        (259, 259, 320, False),
        (330, 320, 320, True),  # tokens added to the tokenizer, not to the model
        (300, 299, 320, True),  # past the vocabulary, even inside vLLM's padded rows
    ],
)
def test_only_a_tokenizer_past_the_models_vocabulary_is_warned(
    caplog, tokenizer_size, vocab, rows, warned
):
    with caplog.at_level("WARNING", logger="engines.startup"):
        warn_vocab_mismatch("e-0", tokenizer_size, vocab, rows)
    assert bool(vocab_warnings(caplog)) == warned


def test_a_padded_vocabulary_is_not_warned_at_start_up(tiny_model, tmp_path, caplog):
    """The demo's tiny model, and a copy whose embeddings were resized to
    64 more rows: more rows than tokens is padding, nothing is wrong."""
    model_dir = tmp_path / "grown-vocab"
    shutil.copytree(tiny_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] += 64  # as vLLM-style padded checkpoints ship
    (model_dir / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.resize_token_embeddings(config["vocab_size"])
    model.save_pretrained(model_dir)
    with caplog.at_level("WARNING", logger="engines.startup"):
        for path in (tiny_model, str(model_dir)):
            padded = make_engine(path)
            run(padded.shutdown())
            assert len(padded.tokenizer) < padded.vocab_size
    assert vocab_warnings(caplog) == []


def test_tokens_added_to_the_tokenizer_alone_are_warned_at_start_up(tiny_model, tmp_path, caplog):
    """A tokenizer grown past the model's vocabulary (its embeddings not
    resized with it) holds ids the engine cannot serve."""
    model_dir = tmp_path / "grown-tokenizer"
    shutil.copytree(tiny_model, model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([f"<|new-{i}|>" for i in range(vocab + 1 - len(tokenizer))])
    tokenizer.save_pretrained(model_dir)
    with caplog.at_level("WARNING", logger="engines.startup"):
        grown = make_engine(str(model_dir))
    run(grown.shutdown())
    tokenizer_size = len(grown.tokenizer)
    assert tokenizer_size == vocab + 1
    (message,) = vocab_warnings(caplog)
    assert f"the tokenizer has {tokenizer_size} tokens" in message
    assert f"vocab_size is {vocab}" in message
    assert f"holds {vocab} embedding rows" in message
    assert f"token ids >= {vocab} cannot be served" in message


def test_importing_the_backend_leaves_torch_to_the_actor():
    """The driver creates the actor from `engines.hf`; torch and transformers
    are imported by the actor, as it starts."""
    assert imported_with("engines.hf") == []
