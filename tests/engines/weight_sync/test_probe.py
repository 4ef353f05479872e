"""The probe after every sync: the comparison itself (unit), and on a real
CPU engine (local Ray, the tiny model) fed by the reference policy through
the bucketed broadcast, with one bucket corrupted by a test hook that flips
bits after packing (so the transfer's checksums agree with what was sent,
and only the probe can tell)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math

import pytest
import ray
import torch
from fp8_emulation import fp8_computed
from policy_probes import ProbedPolicy
from waiting import SETUP_TIMEOUT_S

from engines import (
    EngineStaleError,
    SamplingParams,
    create_vllm_engines,
    destroy_engines,
)
from engines.client import get
from engines.weight_sync import Manifest, ProbeMismatchError, sync_from_checkpoint
from engines.weight_sync.formats.buckets import plan_buckets
from engines.weight_sync.probe import (
    PROBE_LENGTH,
    QUANTIZED_ROUNDOFF,
    ROUNDING_UNITS,
    TOLERANCE_FLOOR,
    ProbeReference,
    ProbeResult,
    check,
    combined,
    probe_tokens,
    reference,
    sequence_logprobs,
    tolerance_for,
)
from engines.weight_sync.transports import broadcast
from training.config import PolicyConfig

REFERENCE = ProbeReference(tuple(range(1, 5)), (-1.0, -2.0, -3.0), tolerance=0.1)


class Host:
    """Stands in for an engine actor's `probe_logprobs`."""

    def __init__(self, logprobs: list[float] | None, quantization: str | None = None):
        self.logprobs, self.quantization = logprobs, quantization

    async def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        return self.logprobs

    def served_quantization(self) -> str | None:
        return self.quantization


def probe(logprobs: list[float] | None) -> ProbeResult:
    return asyncio.run(check(Host(logprobs), REFERENCE, "engine e, version 3"))


def test_logprobs_within_the_tolerance_pass_with_their_differences():
    result = probe([-1.05, -2.0, -2.95])
    assert result.status == "passed"
    assert result.mean_diff == pytest.approx(0.1 / 3) and result.max_diff == pytest.approx(0.05)


def test_a_mismatch_names_both_values():
    with pytest.raises(ProbeMismatchError) as error:
        probe([-1.0, -7.5, -3.0])
    message = str(error.value)
    assert "engine e, version 3" in message and "tolerance 0.1" in message
    assert "position 2: engine -7.5000, trainer -2.0000" in message


def test_non_finite_logprobs_always_fail():
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ProbeMismatchError, match="mean \\|difference\\| inf"):
            probe([-1.0, bad, -3.0])
    with pytest.raises(ProbeMismatchError, match="gave 2 logprobs, the trainer 3"):
        probe([-1.0, -2.0])


def test_an_engine_that_cannot_run_a_request_now_skips_and_says_so():
    result = probe(None)
    assert result.status == "skipped" and "cannot run a request" in result.note
    assert combined([ProbeResult("passed", 0.1, 0.0, 0.0), result]).status == "skipped"


def test_a_bad_reference_is_refused_before_any_engine_sees_it():
    with pytest.raises(ValueError, match="3 logprobs, got 2"):
        ProbeReference((1, 2, 3, 4), (-1.0, -2.0), 0.1)
    with pytest.raises(ValueError, match="not finite"):
        ProbeReference((1, 2), (math.nan,), 0.1)
    with pytest.raises(ValueError, match="positive"):
        ProbeReference((1, 2), (-1.0,), 0.0)


def test_the_prompt_is_fixed_and_inside_the_vocabulary():
    tokens = probe_tokens(320)
    assert tokens == probe_tokens(320) and len(tokens) == PROBE_LENGTH
    assert all(0 <= t < 320 for t in tokens) and len(set(tokens)) == PROBE_LENGTH


def test_the_tolerance_follows_the_coarsest_dtype_the_logits_and_the_depth():
    bf16 = ROUNDING_UNITS * 2 * 2**-8 * 10.0  # 4 layers: sqrt 2
    assert tolerance_for([torch.float32, torch.bfloat16, "bfloat16"], 10.0, 4) == bf16
    assert tolerance_for([torch.float32, torch.bfloat16], 20.0, 4) == 2 * bf16
    assert tolerance_for([torch.float32, torch.float16], 10.0, 4) == bf16 / 8
    assert tolerance_for([torch.float32, torch.float32], 10.0, 4) == TOLERANCE_FLOOR
    with pytest.raises(ValueError, match="no probe tolerance for dtype 'int8'"):
        tolerance_for([torch.float32, "int8"], 10.0, 4)


# --- the reference, on the tiny model's weights, in this process ---------------------------
class ModelHost:
    """An engine's `probe_logprobs` on a model in the engine's dtype (the CPU
    engine's), or computed as vLLM's online FP8 computes it (`quantization`
    "fp8")."""

    def __init__(self, model, quantization: str | None = None):
        self.model, self.quantization = model, quantization

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        with fp8_computed(self.model) if self.quantization else contextlib.nullcontext():
            return sequence_logprobs(self.model, token_ids)

    def served_quantization(self) -> str | None:
        return self.quantization


def synced_pair(tiny_model, sent: torch.dtype, **trainer_config):
    """A float32 trainer (train() mode) and an engine model holding `sent`
    weights; `sync(weights)` copies what the trainer sends into the engine."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model, **trainer_config).train()
    engine = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=sent).eval()

    def step_and_sync(corrupt=None) -> ProbeReference:
        engine_params = dict(engine.named_parameters())
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.02 * p.std())
            sent_weights = {n: p.detach().to(sent) for n, p in trainer.named_parameters()}
            if corrupt is not None:
                corrupt(sent_weights)
            for name, tensor in sent_weights.items():
                engine_params[name].copy_(tensor)
        return reference(trainer, trainer.config.vocab_size, sent)

    return trainer, engine, step_and_sync


@pytest.mark.parametrize(
    ("sent", "config"),
    [(torch.float32, {"attention_dropout": 0.5}), (torch.bfloat16, {"attention_dropout": 0.1})],
    ids=["float32-dropout", "float32-sending-bf16-dropout"],
)
def test_a_trainer_in_train_mode_with_dropout_gets_no_false_alarm(tiny_model, sent, config):
    """The reference runs in eval mode (the engine runs no dropout), and the
    trainer is back in train() after; 20 correct syncs, none flagged."""
    trainer, engine, step_and_sync = synced_pair(tiny_model, sent, **config)
    for version in range(20):
        probe = step_and_sync()
        assert trainer.training
        asyncio.run(check(ModelHost(engine), probe, f"version {version}"))


def test_the_mode_is_restored_when_the_reference_fails(tiny_model, monkeypatch):
    trainer, _, step_and_sync = synced_pair(tiny_model, torch.float32)

    def broken(*args, **kwargs):
        assert not trainer.training  # the reference's forward runs in eval mode
        raise RuntimeError("out of memory")

    monkeypatch.setattr(trainer, "forward", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        step_and_sync()
    assert trainer.training


def scale_one(weights: dict) -> None:
    weights["model.layers.1.mlp.down_proj.weight"] *= 1.1


def test_an_fp8_engine_is_allowed_its_rounding_and_an_unknown_format_is_not_judged():
    """`ProbeReference.tolerance_on`: the engine's own quantization widens
    the tolerance by its roundoff; a format without one is skipped, saying so."""
    probe = ProbeReference((1, 2, 3, 4), (-1.0, -2.0, -3.0), tolerance=0.01, per_roundoff=2.0)
    assert probe.tolerance_on(None) == 0.01
    assert probe.tolerance_on("fp8") == 2.0 * QUANTIZED_ROUNDOFF["fp8"] > 0.01
    assert probe.tolerance_on("awq") is None
    assert REFERENCE.tolerance_on("fp8") == REFERENCE.tolerance  # no per_roundoff: never looser
    off = [-1.05, -2.05, -3.05]
    with pytest.raises(ProbeMismatchError, match="tolerance 0.01;"):
        asyncio.run(check(Host(off), probe, "a bf16 engine"))
    assert asyncio.run(check(Host(off, "fp8"), probe, "an fp8 engine")).status == "passed"
    result = asyncio.run(check(Host(off, "awq"), probe, "an awq engine"))
    assert result.status == "skipped" and "quantization 'awq'" in result.note


def test_an_fp8_engine_has_no_false_alarm_and_a_corruption_still_caught(tiny_model):
    """The GPU format matrix's FP8 engine failed its probe on correct syncs
    (mean 0.024-0.033 against bf16's tolerance of 0.009-0.014): the engine
    quantizes what it is sent, which the trainer's bf16 reference cannot
    see. Here vLLM's FP8 is emulated on the tiny model: 20 correct syncs
    pass on the FP8 tolerance and fail on bf16's; flipped rows are caught."""
    _, engine, step_and_sync = synced_pair(tiny_model, torch.bfloat16)
    fp8 = ModelHost(engine, "fp8")
    for version in range(20):
        probe = step_and_sync()
        asyncio.run(check(fp8, probe, f"version {version}"))
        logprobs = asyncio.run(fp8.probe_logprobs(list(probe.token_ids)))
        with pytest.raises(ProbeMismatchError):
            asyncio.run(check(Host(logprobs), probe, "judged on bf16's tolerance"))

    def flip_rows(weights: dict) -> None:
        weights["model.layers.0.mlp.down_proj.weight"] = weights[
            "model.layers.0.mlp.down_proj.weight"
        ].flip(0)

    with pytest.raises(ProbeMismatchError, match="differ from the trainer's"):
        asyncio.run(check(fp8, step_and_sync(flip_rows), "flipped rows"))


def test_a_float32_trainer_sending_bf16_has_a_scaled_weight_caught(tiny_model):
    """The tolerance from the logits' size and bf16's rounding: a weight
    scaled by 1.1 moves the tiny model's logprobs by less than a tolerance
    by dtype name (0.1) allowed, and more than bf16's rounding does
    (benchmarks/probe_rates.py measures the rates)."""
    _, engine, step_and_sync = synced_pair(tiny_model, torch.bfloat16)
    asyncio.run(check(ModelHost(engine), step_and_sync(), "a correct sync"))
    with pytest.raises(ProbeMismatchError, match="differ from the trainer's"):
        asyncio.run(check(ModelHost(engine), step_and_sync(scale_one), "a corrupted sync"))


# --- on a real engine -----------------------------------------------------------------------
BUCKET_BYTES = 16 * 1024


@pytest.fixture(scope="module")
def cluster(tiny_model, ray_local_module):
    engines = create_vllm_engines(
        1, tiny_model, max_len=64, gpu_memory_utilization=0.5, backend="hf", name_prefix="probe"
    )
    ray.get([e.ready.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
    policy = ProbedPolicy(
        PolicyConfig(pretrain=tiny_model, bucket_bytes=BUCKET_BYTES, sync_timeout_s=20.0)
    )
    policy.init_weight_sync(engines)
    yield engines, policy
    policy.close()
    destroy_engines(engines)


@pytest.fixture
def setup(cluster):
    """The engine serving the policy's weights, the probe on."""
    engines, policy = cluster
    policy.init_weight_sync(engines)
    policy.perturb(0.01, seed=policy.weight_version)
    assert policy.sync_weights().probe.status == "passed"
    return engines, policy


def corrupt_bucket(monkeypatch, index: int, bit: int) -> list[int]:
    """From now on, the trainer's `index`-th packed bucket of each sync gets
    `bit` flipped in every float32 word, after packing (its checksum is
    taken of what is sent). Returns the buckets corrupted, as they are."""
    pack, counter, corrupted = broadcast.pack_bucket, itertools.count(), []
    mask = (1 << bit) - (1 << 32 if bit == 31 else 0)  # as a signed int32

    def packing(bucket, tensors, out=None):
        flat = pack(bucket, tensors, out=out)
        if next(counter) == index:
            words = flat[: flat.numel() // 4 * 4].view(torch.int32)
            words.bitwise_xor_(torch.tensor(mask, dtype=torch.int32))
            corrupted.append(index)
        return flat

    monkeypatch.setattr(broadcast, "pack_bucket", packing)
    return corrupted


def served(engine) -> bool:
    """False: refused as a stale engine (an engine failure: the work goes elsewhere)."""
    try:
        get(engine.generate.remote([5, 6, 7], SamplingParams(max_tokens=2)), 30)
    except EngineStaleError as exc:
        assert "holds stale weights" in str(exc)
        return False
    return True


def test_a_clean_sync_passes_the_probe_and_reports_it(setup):
    engines, policy = setup
    policy.perturb(0.01, seed=1)
    report = policy.sync_weights()
    assert report.probe.status == "passed" and report.probe.seconds > 0
    # Same weights, same float32 code: only summation order differs.
    assert report.probe.mean_diff < 1e-4
    assert report.phases["probe_reference"] > 0
    assert report.as_dict()["probe"]["status"] == "passed"


def held_or_old(ref, version: int) -> bool:
    """A request sent as a sync began: held until the probe failed (True),
    or answered wholly on `version`, the weights before (False)."""
    try:
        output = get(ref, 30)
    except EngineStaleError as exc:
        assert "its probe failed" in str(exc)
        return True
    assert output.weight_versions == [version], output.weight_versions
    return False


def test_the_probe_catches_20_of_20_syncs_with_a_corrupted_bucket(setup, monkeypatch):
    engines, policy = setup
    engine = engines[0]
    buckets = len(plan_buckets(Manifest.of(policy.named_weights()), BUCKET_BYTES).buckets)
    assert buckets > 10  # so the 20 syncs corrupt many different buckets
    caught = held = 0
    for attempt in range(20):
        served_version = get(engine.weight_status.remote(), 30).version
        # The sign bit, or the exponent's top bit, of every word of one bucket.
        corrupted = corrupt_bucket(monkeypatch, attempt * 7 % buckets, 31 if attempt % 2 else 30)
        policy.perturb(0.01, seed=100 + attempt)
        # Work in flight as the sync begins: frozen across it and held for
        # the probe (or, had it been quick, answered before the sync).
        racing = engine.generate.remote([5, 6, 7], SamplingParams(max_tokens=40))
        with pytest.raises(ProbeMismatchError, match="differ from the trainer's"):
            policy.sync_weights()
        held += held_or_old(racing, served_version)
        assert corrupted, "the hook did not run"
        status = get(engine.weight_status.remote(), 30)
        assert status.stale and status.version == served_version
        assert not served(engine)  # refused: nothing was served on those weights
        caught += 1
        monkeypatch.undo()
        # Healthy again before the next attempt: its work is let in.
        policy.perturb(0.01, seed=500 + attempt)
        assert policy.sync_weights().probe.status == "passed"
    assert caught == 20
    assert held, "no request was in flight as a sync began: the hold was not tried"
    assert served(engine)


def test_with_the_probe_off_the_same_corruption_is_served(setup, monkeypatch):
    engines, policy = setup
    policy.init_weight_sync(
        engines, sync_config={"bucket_bytes": BUCKET_BYTES, "timeout_s": 20.0, "probe": False}
    )
    corrupt_bucket(monkeypatch, 0, 31)
    policy.perturb(0.01, seed=7)
    report = policy.sync_weights()
    assert report.probe == ProbeResult("off")
    assert served(engines[0])  # the checksums agree with what was sent


def test_a_sync_without_a_reference_reports_the_probe_skipped(setup, tmp_path):
    engines, policy = setup
    policy.perturb(0.01, seed=3)
    path = policy.save_checkpoint(str(tmp_path / "v"))
    report = sync_from_checkpoint(engines, path)
    assert report.probe.status == "skipped" and "no reference" in report.probe.note


def test_a_probe_without_an_answer_in_time_is_skipped_not_a_failure():
    """No evidence against the weights (vLLM queues the probe behind the
    requests a pause preempted): the engine is not marked stale for it."""

    class Slow(Host):
        async def probe_logprobs(self, token_ids):
            raise TimeoutError

    result = asyncio.run(check(Slow(None), REFERENCE, "engine e, version 3"))
    assert result.status == "skipped" and result.note.startswith("no answer in")
