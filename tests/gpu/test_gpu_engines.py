"""The seed's usage example on real GPUs, then what one engine must do there:
generate (batched, concurrent, seeded), reject bad requests and keep serving,
report its GPU, pause/resume (keep across a sync, wait, abort) and sleep/wake."""

from __future__ import annotations

import time

import pytest
from gpu_helpers import assert_logprob_parity, kill_engine_core, wait_gpus_released, wait_ready
from waiting import wait_until

from engines import (
    EngineSleepingError,
    PromptTooLongError,
    RequestError,
    SamplingParams,
    create_vllm_engines,
    destroy_engines,
)
from engines.load import EngineLoad

pytestmark = pytest.mark.gpu

MAX_LEN = 2048
UTILIZATION = 0.3
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engines(ray_gpu, gpu_model, gpu_count, gpu_baseline):
    # The usage example: one engine per GPU (two on the 2-GPU host), TP=1.
    # Sleep mode is on so the sleep test can reuse these engines.
    engines = create_vllm_engines(
        num_engines=min(2, gpu_count),
        pretrain=gpu_model,
        max_len=MAX_LEN,
        gpu_memory_utilization=UTILIZATION,
        tensor_parallel_size=1,
        backend="vllm",
        name_prefix="gpu-usage",
        enforce_eager=True,
        enable_sleep_mode=True,
    )
    try:
        wait_ready(engines, f"{len(engines)} TP=1 engine(s)")
        yield engines
    finally:
        destroy_engines(engines)
        wait_gpus_released(gpu_baseline)


def prompts_of(ray, engine, texts: list[str]) -> list[list[int]]:
    return ray.get([engine.encode.remote(text) for text in texts], timeout=TIMEOUT_S)


def test_usage_example_generates_on_every_engine(ray_gpu, engines, hf_reference):
    ray = ray_gpu
    prompts = prompts_of(ray, engines[0], ["The quick brown fox", "def main():", "1 2 3 4"])
    results = ray.get([e.generate.remote(prompts, GREEDY) for e in engines], timeout=TIMEOUT_S)
    for engine_index, outputs in enumerate(results):
        assert len(outputs) == len(prompts)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.engine == engines.names[engine_index]
            assert output.weight_version == 0
            assert output.prompt_token_ids == prompt
            (completion,) = output.outputs
            assert len(completion.token_ids) == 32 and completion.finish_reason == "length"
            for entry, token in zip(completion.logprobs, completion.token_ids, strict=True):
                assert token in entry and len(entry) <= 3
                assert all(lp.logprob <= 0.0 for lp in entry.values())
            pairs = zip(completion.logprobs, completion.token_ids, strict=True)
            sampled = sum(entry[token].logprob for entry, token in pairs)
            assert completion.cumulative_logprob == pytest.approx(sampled, abs=1e-3)
    # Same weights and greedy decoding: every engine (GPU) gives the same tokens.
    tokens = [[o.outputs[0].token_ids for o in outputs] for outputs in results]
    assert all(t == tokens[0] for t in tokens)
    # The tokens are the model's: their logprobs match transformers' (bf16).
    for prompt, output in zip(prompts, results[0], strict=True):
        assert_logprob_parity(hf_reference, prompt, output.outputs[0])


def test_concurrent_calls_share_batches(ray_gpu, engines):
    ray = ray_gpu
    engine = engines[0]
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    batch = [[5 + (i * 7 + j) % 250 for j in range(32)] for i in range(8)]
    start = time.monotonic()
    ray.get(engine.generate.remote(batch, params), timeout=TIMEOUT_S)
    one_call = time.monotonic() - start

    start = time.monotonic()
    refs = [engine.generate.remote(batch, params) for _ in range(16)]
    in_flight = ray.get(engine.get_num_unfinished_requests.remote(), timeout=TIMEOUT_S)
    results = ray.get(refs, timeout=TIMEOUT_S)
    sixteen_calls = time.monotonic() - start
    print(f"one call {one_call:.2f}s, 16 concurrent calls {sixteen_calls:.2f}s")
    assert all(len(r) == 8 and len(r[0].outputs[0].token_ids) == 64 for r in results)
    assert in_flight > 0
    assert ray.get(engine.get_num_unfinished_requests.remote(), timeout=TIMEOUT_S) == 0
    # Continuous batching: 16x the work in far less than 16x the time (eager
    # decoding of a small model is launch-bound, so a wider batch is nearly free).
    assert sixteen_calls < 4 * one_call


def test_load_reports_vllms_scheduler(ray_gpu, engines):
    """`load()` from vLLM's SchedulerStats: running sequences (n counts each)
    and KV cache use while requests run, nothing once they are done."""
    ray = ray_gpu
    engine = engines[0]
    assert ray.get(engine.load.remote(), timeout=TIMEOUT_S) == EngineLoad(0, 0, 0.0)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=1024, ignore_eos=True)
    batch = [[5 + (i * 7 + j) % 250 for j in range(256)] for i in range(16)]
    ref = engine.generate.remote(batch, params)

    def every_sequence_in() -> EngineLoad | None:
        load = ray.get(engine.load.remote(), timeout=TIMEOUT_S)
        return load if load.running > 0 and load.running + load.waiting == 64 else None

    seen = wait_until(every_sequence_in, TIMEOUT_S, "a load report with 64 sequences in")
    print(f"load while generating: {seen}")
    assert 0.0 < seen.kv_cache_usage <= 1.0
    ray.get(ref, timeout=TIMEOUT_S)
    assert ray.get(engine.load.remote(), timeout=TIMEOUT_S) == EngineLoad(0, 0, 0.0)


def test_n_samples_and_seeds(ray_gpu, engines):
    import vllm

    ray = ray_gpu
    engine = engines[0]
    prompt = prompts_of(ray, engine, ["Once upon a time"])[0]
    ours = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=1234, ignore_eos=True)
    native = vllm.SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=1234, ignore_eos=True)
    # Sent together so they decode in the same batches: logits are then the
    # same bits, and the seeded samplers alone decide the tokens.
    results = ray.get(
        [engine.generate.remote(prompt, p) for p in (ours, ours, native)], timeout=TIMEOUT_S
    )
    samples = [[c.token_ids for c in result.outputs] for result in results]
    assert [c.index for c in results[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples[0]}) > 1  # different samples, not copies
    # Same seed, same tokens; a vllm.SamplingParams passed as is behaves the same.
    assert samples[1] == samples[0] and samples[2] == samples[0]


def test_bad_requests_leave_the_engine_serving(ray_gpu, engines):
    ray = ray_gpu
    engine = engines[0]
    with pytest.raises(PromptTooLongError):
        ray.get(engine.generate.remote([7] * MAX_LEN, GREEDY), timeout=TIMEOUT_S)
    with pytest.raises(RequestError, match="out of vocabulary"):
        ray.get(engine.generate.remote([7, 100_000], GREEDY), timeout=TIMEOUT_S)
    with pytest.raises(RequestError):
        ray.get(engine.generate.remote([7, 8], {"n": 2, "temperature": 0.0}), timeout=TIMEOUT_S)
    output = ray.get(engine.generate.remote([7, 8, 9], GREEDY), timeout=TIMEOUT_S)
    assert len(output.outputs[0].token_ids) == 32


def test_health_names_the_gpu(ray_gpu, engines):
    ray = ray_gpu
    healths = ray.get([e.health.remote() for e in engines], timeout=TIMEOUT_S)
    for health in healths:
        assert health["alive"] and health["backend"] == "vllm"
        (gpu,) = health["gpus"]
        assert gpu["device"].startswith("cuda")
        # The engine's budget is UTILIZATION of the card, nearly all taken up front.
        assert gpu["used_bytes"] > 0.8 * UTILIZATION * gpu["total_bytes"]
        print(
            f"{health['name']}: {gpu['gpu_name']} {gpu['gpu_uuid']}, "
            f"{gpu['used_bytes'] / 2**30:.1f} GiB used"
        )
    # One engine per GPU: they must not share a device.
    assert len({h["gpus"][0]["gpu_uuid"] for h in healths}) == len(engines)


def pause_with_work_in_flight(ray, engine, mode: str, max_tokens: int):
    """Start a long greedy request, pause in `mode` once it is inside vLLM (a
    fixed sleep raced with a busy host); returns its ref and the pause's seconds."""
    long = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    running = engine.generate.remote([7, 8, 9], long)
    deadline = time.monotonic() + TIMEOUT_S
    while not ray.get(engine.get_num_unfinished_requests.remote(), timeout=TIMEOUT_S):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    start = time.monotonic()
    ray.get(engine.pause_generation.remote(mode=mode), timeout=TIMEOUT_S)
    return running, time.monotonic() - start


def test_pause_keep_freezes_work_in_flight_across_a_weight_sync(
    ray_gpu, engines, hf_reference, tmp_path
):
    """OpenRLHF's pause (vLLM's mode="keep"): returns within 1 s with a long
    request in flight, a sync runs under the frozen request, and after resume
    it finishes, its output naming both weight versions."""
    from engines.weight_sync.transports import checkpoint

    ray = ray_gpu
    engine = engines[0]
    served = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["weight_version"]
    weights = hf_reference.state_dict()  # the engine's weights, in its dtype
    original = checkpoint.save(weights.items(), tmp_path / "original")
    scaled = {
        name: tensor * 1.5 if "lm_head" in name or "embed" in name else tensor
        for name, tensor in weights.items()
    }
    path = checkpoint.save(scaled.items(), tmp_path / "scaled")
    running, pause_s = pause_with_work_in_flight(ray, engine, "keep", 1536)
    print(f"pause_generation(keep) with a request in flight: {pause_s * 1000:.0f} ms")
    assert pause_s < 1.0
    queued = engine.generate.remote([7, 8, 9], GREEDY)
    ready, _ = ray.wait([running, queued], num_returns=1, timeout=2.0)
    assert not ready, "a paused engine generated"
    ray.get(engine.load_checkpoint.remote(str(path), version=served + 1), timeout=TIMEOUT_S)
    ready, _ = ray.wait([running, queued], num_returns=1, timeout=1.0)
    assert not ready, "the sync's own resume let requests go"
    ray.get(engine.resume_generation.remote(), timeout=TIMEOUT_S)
    output = ray.get(running, timeout=TIMEOUT_S)
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 1536
    assert output.weight_versions == [served, served + 1]
    assert ray.get(queued, timeout=TIMEOUT_S).weight_versions == [served + 1]
    # Back to the model's weights for the tests after this one.
    ray.get(engine.load_checkpoint.remote(str(original), version=served + 2), timeout=TIMEOUT_S)


def test_pause_wait_lets_work_in_flight_finish_and_queues_new_work(ray_gpu, engines):
    ray = ray_gpu
    engine = engines[0]
    running, _ = pause_with_work_in_flight(ray, engine, "wait", 1024)
    # The request in flight ran to completion, not aborted.
    output = ray.get(running, timeout=5)
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 1024
    queued = engine.generate.remote([7, 8, 9], GREEDY)
    ready, _ = ray.wait([queued], timeout=2.0)
    assert not ready, "a paused engine generated"
    assert ray.get(engine.health.remote(), timeout=TIMEOUT_S)["paused"]
    ray.get(engine.resume_generation.remote(), timeout=TIMEOUT_S)
    output = ray.get(queued, timeout=TIMEOUT_S)
    assert len(output.outputs[0].token_ids) == 32


def test_pause_abort_ends_work_in_flight(ray_gpu, engines):
    ray = ray_gpu
    engine = engines[0]
    running, _ = pause_with_work_in_flight(ray, engine, "abort", 1536)
    output = ray.get(running, timeout=5)
    assert output.outputs[0].finish_reason == "abort"
    assert len(output.outputs[0].token_ids) < 1536
    ray.get(engine.resume_generation.remote(), timeout=TIMEOUT_S)
    assert ray.get(engine.generate.remote([7, 8, 9], GREEDY), timeout=TIMEOUT_S).outputs


def test_sleep_frees_gpu_memory_and_wake_up_restores_service(ray_gpu, engines):
    ray = ray_gpu
    engine = engines[0]
    prompt = [7, 8, 9, 10]
    before = ray.get(engine.generate.remote(prompt, GREEDY), timeout=TIMEOUT_S)
    awake = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["gpus"][0]

    start = time.monotonic()
    ray.get(engine.sleep.remote(level=1), timeout=TIMEOUT_S)
    slept_s = time.monotonic() - start
    health = ray.get(engine.health.remote(), timeout=TIMEOUT_S)
    asleep = health["gpus"][0]
    assert health["sleeping"] == ["kv_cache", "weights"]
    with pytest.raises(EngineSleepingError):
        ray.get(engine.generate.remote(prompt, GREEDY), timeout=TIMEOUT_S)

    start = time.monotonic()
    ray.get(engine.wake_up.remote(), timeout=TIMEOUT_S)
    woke_s = time.monotonic() - start
    freed = awake["used_bytes"] - asleep["used_bytes"]
    budget = UTILIZATION * awake["total_bytes"]
    print(
        f"sleep(level=1): {awake['used_bytes'] / 2**30:.2f} -> {asleep['used_bytes'] / 2**30:.2f}"
        f" GiB used on the GPU, freed {freed / 2**30:.2f} GiB in {slept_s:.2f}s "
        f"({freed / budget:.0%} of the engine's budget); wake_up {woke_s:.2f}s"
    )
    assert freed > 0.8 * budget
    after = ray.get(engine.generate.remote(prompt, GREEDY), timeout=TIMEOUT_S)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert ray.get(engine.health.remote(), timeout=TIMEOUT_S)["sleeping"] == []


def test_killed_engine_core_restarts_in_its_actor(ray_gpu, engines, hf_reference):
    """vLLM's engine core is killed (SIGKILL, as the kernel's OOM killer or a
    GPU fault ends it) under its live actor: the engine is reported dead,
    then started again in the same actor, serving the pretrained weights at
    version 0 (an earlier test synced others into it)."""
    from engines import EngineDeadError, restart_engine
    from engines.client import get

    ray = ray_gpu
    engine = engines[0]
    before = get(engine.health.remote(), TIMEOUT_S)
    killed = kill_engine_core(engine)

    def reported_dead() -> bool:
        try:
            get(engine.health.remote(), TIMEOUT_S)
        except EngineDeadError:
            return True
        return False

    wait_until(reported_dead, TIMEOUT_S, "the engine core's death to be reported")

    start = time.monotonic()
    assert restart_engine(engines, 0)
    wait_ready([engine], "the engine, restarted in its actor")
    prompt = prompts_of(ray, engine, ["The quick brown fox"])[0]
    output = ray.get(engine.generate.remote(prompt, GREEDY), timeout=TIMEOUT_S)
    took = time.monotonic() - start
    after = get(engine.health.remote(), TIMEOUT_S)
    report = get(engine.startup_report.remote(), TIMEOUT_S)
    print(
        f"restart in the actor -> first answer: {took:.1f}s; phases "
        f"{[(p.name, p.seconds) for p in report.phases]}"
    )
    assert after["pid"] == before["pid"]
    assert set(after["engine_core_pids"]).isdisjoint(killed)
    assert after["weight_version"] == 0 and output.weight_version == 0
    assert_logprob_parity(hf_reference, prompt, output.outputs[0])


def test_engine_fields_read_from_source_are_vllms_own():
    """The driver reads AsyncEngineArgs' fields from vLLM's source (no import):
    the same set as the imported dataclass has."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from engines.lifecycle import spec

    spec.vllm_engine_fields.cache_clear()
    assert spec.vllm_engine_fields() == {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_vocab_padding_is_vllms():
    """The backend pads the vocabulary as vLLM does without importing vLLM's
    embedding module for it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        DEFAULT_VOCAB_PADDING_SIZE,
        pad_vocab_size,
    )

    from engines.vllm.api import VOCAB_PADDING, padded_vocab_rows

    assert VOCAB_PADDING == DEFAULT_VOCAB_PADDING_SIZE
    for vocab in (1, 63, 64, 65, 32000, 151643, 151936):
        assert padded_vocab_rows(vocab) == pad_vocab_size(vocab)
