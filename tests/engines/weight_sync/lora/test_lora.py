"""LoRA adapter-only sync (engines/weight_sync/lora/): the adapter's shape
and the engine's bookkeeping alone, then real CPU engines (local Ray, the
tiny model, peft) synced by the reference policy training an adapter, over
every way an adapter travels on a CPU box (inline, a peft directory)."""

from __future__ import annotations

import copy

import pytest
import ray
import torch
from waiting import SETUP_TIMEOUT_S, wait_until

from engines import SamplingParams, create_vllm_engines, destroy_engines
from engines.client import get
from engines.weight_sync import (
    LoraSender,
    LoraSpec,
    LoraSync,
    ManifestMismatchError,
    SyncConfig,
    WeightSyncError,
    WeightTransferError,
)
from engines.weight_sync.formats.adapter import save_adapter
from engines.weight_sync.lora.engine import AdapterVersions
from training.grpo import token_logprobs
from training.policy import ReferencePolicy

PREFIX = "test-lora"
MAX_RANK = 8
SEQUENCES = [list(range(5, 30)), [7, 99, 3, 250, 18, 64, 64, 12]]
# The same float32 model on both sides, merged (trainer) or not (peft's
# layers on the engine): sums in another order, ~1e-6 measured.
LOGPROB_ATOL = 1e-4
TIMEOUT_S = 30.0


# --- the adapter's shape and the engine's bookkeeping ------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(rank=0, alpha=8.0, target_modules=("q_proj",)),
            "rank must be an integer >= 1, got 0",
        ),
        (
            dict(rank=4, alpha=0.0, target_modules=("q_proj",)),
            "lora_alpha must be positive, got 0.0",
        ),
        (dict(rank=4, alpha=8.0, target_modules=()), "target_modules must be non-empty"),
    ],
)
def test_a_bad_adapter_shape_is_refused_by_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraSpec(**kwargs)


def test_tensors_of_another_rank_are_refused_by_name():
    spec = LoraSpec(4, 8.0, ("q_proj",))
    good = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    spec.check_tensors([(good, torch.zeros(4, 32))])
    with pytest.raises(ValueError, match=r"q_proj.lora_B.weight' has rank 2, the adapter's is 4"):
        spec.check_tensors([(good.replace("lora_A", "lora_B"), torch.zeros(32, 2))])
    with pytest.raises(ValueError, match="not a LoRA tensor"):
        spec.check_tensors([("model.norm.weight", torch.zeros(32))])


def test_old_adapters_go_once_outside_the_window_and_idle():
    versions = AdapterVersions()
    versions.loaded = [1, 2, 3]
    assert versions.to_remove(4, keep=2, served=3) == [1, 2]
    # The version served stays until the sync commits (a failed one serves it on).
    assert versions.to_remove(4, keep=1, served=3) == [1, 2]
    with versions.pinned(2) as adapter:
        assert adapter == 2
        assert versions.to_remove(4, keep=2, served=3) == [1]  # a request still runs on 2
    with versions.pinned(0) as adapter:
        assert adapter is None  # version 0 has no adapter: the base model
    assert versions.to_remove(4, keep=3, served=3) == [1]


class CopiesWaitedOn:
    """Stands in for `CopyEvents` (opening a CUDA event needs a GPU); with
    `error`, the wait fails as CUDA's would for an engine gone mid-copy."""

    def __init__(self, error: Exception | None = None) -> None:
        self.waited: list[list[bytes]] = []
        self.error = error

    def wait(self, handles: list[bytes], device, timeout_s: float) -> None:
        self.waited.append(list(handles))
        if self.error is not None:
            raise self.error

    def clear(self) -> None:
        pass


def sender_with_copies_pending(events: CopiesWaitedOn) -> LoraSender:
    sender = LoraSender("cuda_ipc", LoraSync(LoraSpec(4, 8.0, ("q_proj",))), SyncConfig())
    sender._copy_events = events
    sender._packed = (None, type("Packed", (), {"buffer": torch.zeros(1)})())
    sender._copies = [b"event-of-engine-0", b"event-of-engine-1"]
    return sender


def test_the_trainer_frees_its_packed_buffer_only_once_the_engines_copied_it():
    # Over CUDA IPC the engines answer with their copy out of the trainer's
    # buffer queued; the buffer must outlive that copy.
    events = CopiesWaitedOn()
    sender = sender_with_copies_pending(events)
    sender.close()
    assert events.waited == [[b"event-of-engine-0", b"event-of-engine-1"]]
    assert sender._packed is None
    sender.close()  # nothing left to wait on
    assert len(events.waited) == 1


def test_closing_after_an_engine_died_mid_copy_still_lets_everything_go(caplog):
    error = WeightTransferError("waiting for an engine's copies failed: CUDA error")
    sender = sender_with_copies_pending(CopiesWaitedOn(error))
    sender.close()
    assert sender._packed is None and sender.engines == []
    assert "copies failed: CUDA error" in caplog.text


def test_an_adapter_directory_is_peft_s_own(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = ReferencePolicy(lora_config(tiny_model))
    perturb_adapter(policy, seed=1)
    path = save_adapter(policy.named_weights(), policy.lora.spec, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(path)).eval()
    assert max_diff(logprobs_of(loaded), logprobs_of(policy.model)) <= LOGPROB_ATOL


# --- real engines ----------------------------------------------------------------------------
def lora_config(tiny_model: str, **extra) -> dict:
    return {
        "pretrain": tiny_model,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lora_target_modules": ("q_proj", "v_proj", "down_proj"),
        "max_staleness": 1,
        "sync_timeout_s": TIMEOUT_S,
        **extra,
    }


def perturb_adapter(policy: ReferencePolicy, seed: int) -> int:
    """New adapter values (peft starts B at zero) and a new version."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in policy.model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    policy.weight_version += 1
    return policy.weight_version


def logprobs_of(model) -> list[list[float]]:
    with torch.no_grad():
        rows = token_logprobs(model, SEQUENCES, 0)
    return [row[: len(s) - 1].tolist() for row, s in zip(rows, SEQUENCES, strict=True)]


def engine_logprobs(engine) -> tuple[list[list[float]], int]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = get(engine.generate.remote(SEQUENCES, params), 60)
    logprobs = [
        [
            step[t].logprob
            for step, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
        ]
        for o in outputs
    ]
    return logprobs, outputs[0].weight_version


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens
        )
    return out[0, len(prompt) :].tolist()


def max_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.fixture(scope="module")
def engines(tiny_model, ray_local_module):
    engines = create_vllm_engines(
        2,
        tiny_model,
        max_len=128,
        backend="hf",
        name_prefix=PREFIX,
        enable_lora=True,
        max_lora_rank=MAX_RANK,
    )
    ray.get([e.ready.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
    yield engines
    destroy_engines(engines)


def synced_policy(tiny_model, engines, tmp_path, transport):
    policy = ReferencePolicy(
        lora_config(tiny_model, transport=transport, checkpoint_dir=str(tmp_path))
    )
    # Engines of the shared set may serve a later version from another test.
    policy.weight_version = max(get(e.weight_status.remote(), 30).version for e in engines)
    summary = policy.init_weight_sync(engines)
    assert summary["via"] == {"broadcast": "inline", "checkpoint": "checkpoint"}[transport]
    return policy


@pytest.mark.parametrize("transport", ["broadcast", "checkpoint"])
def test_engines_serve_the_trainer_s_merged_model_after_each_sync(
    tiny_model, engines, tmp_path, transport
):
    policy = synced_policy(tiny_model, engines, tmp_path, transport)
    base_logprobs = logprobs_of(copy.deepcopy(policy.model).merge_and_unload())
    first = policy.weight_version + 1
    for seed in range(3):
        version = perturb_adapter(policy, seed)
        report = policy.sync_weights()
        assert report.transport == f"lora-{'inline' if transport == 'broadcast' else 'checkpoint'}"
        assert report.version == version and report.bytes > 0
        merged = copy.deepcopy(policy.model).merge_and_unload().eval()
        expected = logprobs_of(merged)
        assert max_diff(expected, base_logprobs) > 0.1  # the adapter changes the model
        for engine in engines:
            logprobs, served = engine_logprobs(engine)
            assert served == version
            assert max_diff(logprobs, expected) <= LOGPROB_ATOL
        prompt = SEQUENCES[1]
        out = get(
            engines[0].generate.remote(
                prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            ),
            60,
        )
        assert out.outputs[0].token_ids == greedy(merged, prompt, 6)
    # max_staleness 1: the engines keep this version's adapter and the one before.
    for engine in engines:
        assert get(engine.lora_adapters.remote(), 30) == [
            f"rolloutflow-v{v}" for v in (first + 1, first + 2)
        ]
    policy.close()


def test_bad_adapters_are_refused_by_value_and_change_nothing(tiny_model, engines, tmp_path):
    policy = synced_policy(tiny_model, engines, tmp_path, "broadcast")
    perturb_adapter(policy, seed=7)
    policy.sync_weights()
    served = policy.weight_version
    before = [engine_logprobs(e)[0] for e in engines]
    weights = policy.named_weights()
    config = SyncConfig(timeout_s=TIMEOUT_S)

    too_wide = LoraSender("inline", LoraSync(LoraSpec(16, 32.0, ("q_proj",))), config)
    too_wide.init(engines)
    wide = [(n, torch.zeros(16, 32)) for n, _ in weights if ".q_proj.lora_A." in n]
    with pytest.raises(WeightSyncError, match=f"rank 16 is above its max_lora_rank={MAX_RANK}"):
        too_wide.sync(wide, served + 1)

    unknown = LoraSender("inline", LoraSync(LoraSpec(4, 8.0, ("qkv_fused",))), config)
    unknown.init(engines)
    renamed = [(n.replace("q_proj", "qkv_fused"), t) for n, t in weights if "q_proj" in n]
    with pytest.raises(ManifestMismatchError, match=r"target modules \['qkv_fused'\]"):
        unknown.sync(renamed, served + 1)

    for engine, logprobs in zip(engines, before, strict=True):
        status = get(engine.weight_status.remote(), 30)
        assert (status.version, status.stale) == (served, False)
        assert engine_logprobs(engine)[0] == logprobs
    policy.close()


def test_an_engine_without_lora_refuses_an_adapter(tiny_model, ray_local):
    # The set, not its one handle, is destroyed: it knows its placement group.
    started = create_vllm_engines(
        1, tiny_model, max_len=64, backend="hf", name_prefix="test-nolora"
    )
    (engine,) = started
    try:
        # Up first: the sync's own deadline is not a start-up's.
        get(engine.ready.remote(), 300)
        sender = LoraSender("inline", LoraSync(LoraSpec(4, 8.0, ("q_proj",))), SyncConfig())
        sender.init([engine])
        name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        with pytest.raises(WeightSyncError, match="without enable_lora=True"):
            sender.sync([(name, torch.zeros(4, 32))], 1)
        assert get(engine.weight_status.remote(), 30).stale is False
    finally:
        destroy_engines(started)


def test_a_request_finishes_on_the_adapter_it_was_admitted_under(tiny_model, engines, tmp_path):
    """A sync under a running request (in_flight): the request keeps its
    version's adapter to its end; the next request gets the new one."""
    policy = synced_policy(tiny_model, engines, tmp_path, "broadcast")
    admitted = perturb_adapter(policy, seed=11)
    policy.sync_weights()
    merged = copy.deepcopy(policy.model).merge_and_unload().eval()
    engine, prompt, tokens = engines[0], SEQUENCES[0], 90
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    running = engine.generate.remote(prompt, params)
    unfinished = engine.get_num_unfinished_requests
    wait_until(
        lambda: get(engine.get_num_unfinished_requests.remote(), 30), 30, "the request to run"
    )
    # Frozen where it is, as a sync's begin freezes it: the sync lands mid-request.
    get(engine.pause_generation.remote("keep"), 30)
    assert get(unfinished.remote(), 30) == 1, "it ended before the sync"
    perturb_adapter(policy, seed=12)
    policy.sync_weights()
    get(engine.resume_generation.remote(), 30)
    out = get(running, 120)
    assert out.weight_versions == [admitted]
    assert out.outputs[0].token_ids == greedy(merged, prompt, tokens)
    after = get(engine.generate.remote(prompt, SamplingParams(max_tokens=4, temperature=0.0)), 60)
    assert after.weight_versions == [policy.weight_version]
    policy.close()
