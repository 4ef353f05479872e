"""The reference policy's train step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from training.config import PolicyConfig
from training.grpo import token_logprobs
from training.policy import (
    ReferencePolicy,
    alloc_retries,
    checkpoint_dtype,
    engine_dtype,
    tf32_matmuls,
)
from training.rollouts import RolloutGroup, RolloutSample


def groups() -> list[RolloutGroup]:
    """Two prompts of four samples each, of different lengths and rewards."""
    made = []
    for prompt in ([5, 6, 7], [8, 9]):
        samples = [
            RolloutSample(
                prompt_token_ids=prompt,
                completion_token_ids=[10 + k] * (2 + 3 * k),
                weight_version=0,
                reward=float(k % 2),
            )
            for k in range(4)
        ]
        made.append(RolloutGroup(samples=samples))
    return made


def test_micro_batches_give_the_step_of_one_batch(tiny_model):
    """The gradient accumulated over micro-batches is the whole batch's (the
    same loss and gradients; Adam's update of a near-zero gradient would
    magnify float rounding, so the weights are not compared)."""
    whole = ReferencePolicy(PolicyConfig(pretrain=tiny_model, learning_rate=0.01))
    split = ReferencePolicy(
        PolicyConfig(pretrain=tiny_model, learning_rate=0.01, micro_batch_tokens=12)
    )
    a, b = whole.train_step(groups()), split.train_step(groups())
    assert a.trained_samples == b.trained_samples == 8
    assert a.trained_tokens == b.trained_tokens == 4 * 3 + 4 * 2 + 2 * (2 + 5 + 8 + 11)
    assert abs(a.loss - b.loss) < 1e-6 and abs(a.grad_norm - b.grad_norm) < 1e-5
    for (name, p), (_, q) in zip(
        whole.model.named_parameters(), split.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_bf16_step_computes_under_autocast_and_keeps_float32_weights(tiny_model):
    """`compute_dtype="bfloat16"`: the step's gradients come from a bf16
    forward and backward (near the float32 step's, not equal to them), while
    the weights, their gradients and Adam's state stay float32. (An
    on-policy first step's loss is 0 in both: ratio 1, advantages centred.)"""
    full = ReferencePolicy(PolicyConfig(pretrain=tiny_model, learning_rate=0.01))
    half = ReferencePolicy(
        PolicyConfig(pretrain=tiny_model, learning_rate=0.01, compute_dtype="bfloat16")
    )
    a, b = full.train_step(groups()), half.train_step(groups())
    assert a.grad_norm != b.grad_norm and abs(a.grad_norm - b.grad_norm) < 0.1 * a.grad_norm
    assert {p.dtype for p in half.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in half.model.parameters()} == {torch.float32}
    state = [t for s in half.optimizer.state.values() for t in s.values() if t.dim()]
    assert state and {t.dtype for t in state} == {torch.float32}
    # Outside the step nothing is left under autocast (the probe's reference).
    assert not torch.is_autocast_enabled("cpu")


def test_a_lora_policy_trains_and_sends_its_adapter_only(tiny_model):
    config = PolicyConfig(
        pretrain=tiny_model,
        learning_rate=0.05,
        lora_rank=4,
        lora_alpha=8.0,
        lora_target_modules=("q_proj", "v_proj"),
        max_staleness=2,
    )
    policy = ReferencePolicy(config)
    lora = policy.lora_sync()
    assert (lora.spec.rank, lora.spec.alpha, lora.keep) == (4, 8.0, 3)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}
    sent = dict(policy.named_weights())
    layers = policy.model.config.num_hidden_layers
    assert len(sent) == layers * 2 * 2  # q and v, lora_A and lora_B
    assert all(n.startswith("base_model.model.") and ".lora_" in n for n in sent)
    before = {n: t.clone() for n, t in sent.items()}
    # Nonzero B first: with peft's zero B, A's gradient is zero.
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    report = policy.train_step(groups())
    assert report.trained_samples == 8 and report.version == 1
    after = dict(policy.named_weights())
    assert all(not torch.equal(after[n], before[n]) for n in sent if ".lora_A." in n)
    for name, p in policy.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name]), f"the frozen base changed: {name}"


def test_a_lora_target_that_is_no_module_is_refused_by_name(tiny_model):
    config = PolicyConfig(pretrain=tiny_model, lora_rank=4, lora_target_modules=("qkv_fused",))
    with pytest.raises(ValueError, match="qkv_fused"):
        ReferencePolicy(config)


#: A two-turn response stream: sampled, environment, sampled (mask 1, 0, 1).
STREAM = [40, 41, 42, 90, 91, 92, 93, 50, 51]
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1]


def test_a_masked_stream_trains_as_its_sampled_tokens(tiny_model):
    """Behaviour logprobs are 0.0 on environment tokens (as a trajectory
    carries them): the off-policy correction reads the sampled tokens only,
    so rows whose sampled tokens carry the policy's own logprobs show no
    mismatch. The oldest sampled token's version is the row's staleness,
    and a row with nothing sampled is not trained."""
    policy = ReferencePolicy(PolicyConfig(pretrain=tiny_model, max_staleness=3))
    policy.weight_version = 3
    prompt = [5, 6, 7]
    with torch.no_grad():
        (own,) = token_logprobs(policy.model, [prompt + STREAM])
    own = own[len(prompt) - 1 :].tolist()
    samples = [
        RolloutSample(
            prompt_token_ids=prompt,
            completion_token_ids=STREAM,
            logprobs=[lp if m else 0.0 for lp, m in zip(own, MASK, strict=True)],
            loss_mask=MASK,
            token_versions=[1, 1, 1, -1, -1, -1, -1, 2, 2] if k == 0 else None,
            weight_version=3 if k else 2,
            reward=float(k),
        )
        for k in range(2)
    ]
    idle = RolloutSample(
        prompt_token_ids=prompt,
        completion_token_ids=[90, 91],
        loss_mask=[0, 0],
        weight_version=3,
        reward=5.0,
    )
    report = policy.train_step([RolloutGroup(samples=[*samples, idle])])
    assert report.trained_samples == 2
    assert report.logprob_mismatch < 1e-5
    assert report.staleness_max == 2


def test_a_sync_sends_the_dtype_the_engines_hold(tiny_model):
    """The tiny model is saved in float32: the CPU engine keeps it, vLLM's
    "auto" serves it in bf16 (an H200 run's first sync was refused when the
    policy sent float32); an engine's own dtype argument wins."""
    assert engine_dtype(tiny_model, "hf", {}) == "float32"
    assert engine_dtype(tiny_model, "vllm", {}) == "bfloat16"
    assert engine_dtype(tiny_model, "vllm", {"dtype": "half"}) == "float16"
    assert engine_dtype(tiny_model, "vllm", {"dtype": "float32"}) == "float32"
    with pytest.raises(ValueError, match="'int8'"):
        engine_dtype(tiny_model, "vllm", {"dtype": "int8"})


@pytest.mark.parametrize(
    "saved, expected",
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16", "torch_dtype": "bfloat16"}, "float16"),
        ({"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),
        ({}, "float32"),
    ],
)
def test_a_checkpoints_dtype_is_read_as_transformers_reads_it(tmp_path, saved, expected):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **saved}))
    assert checkpoint_dtype(str(tmp_path)) == expected
    assert str(AutoConfig.from_pretrained(tmp_path).dtype or "float32") in (
        expected,
        f"torch.{expected}",
    )


def test_the_flows_process_asks_the_engines_dtype_without_transformers(tiny_model):
    """The flow's process asks it before it starts the policy: importing
    transformers there delayed the policy's start."""
    code = (
        "import sys, flows.cli, flows.rollout\n"
        "from training.policy import engine_dtype\n"
        f"assert engine_dtype({tiny_model!r}, 'vllm', {{}}) == 'bfloat16'\n"
        "print(sorted({'transformers', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_tf32_matmuls_hold_for_a_cuda_step_only():
    """TF32 inside a CUDA step, the caller's precision restored after it
    (also when the step fails); a CPU step leaves the setting alone."""
    before = torch.get_float32_matmul_precision()
    with tf32_matmuls(torch.device("cpu")):
        assert torch.get_float32_matmul_precision() == before
    with pytest.raises(RuntimeError), tf32_matmuls(torch.device("cuda")):
        assert torch.get_float32_matmul_precision() == "high"
        raise RuntimeError("the step failed")
    assert torch.get_float32_matmul_precision() == before


def test_a_step_whose_allocations_retried_says_so(tiny_model, monkeypatch, caplog):
    """CUDA's allocator retries (its count stands in here: this box has no
    GPU) slow a step with nothing in the report to say why: the log says it."""
    policy = ReferencePolicy(PolicyConfig(pretrain=tiny_model, max_staleness=1))
    counts = iter([0, 0, 0, 3])
    monkeypatch.setattr("training.policy.alloc_retries", lambda device: next(counts))
    with caplog.at_level("WARNING", logger="training.policy"):
        policy.train_step(groups())
        assert "retried" not in caplog.text
        policy.train_step(groups())
    assert "step 2: the CUDA allocator ran out of memory and retried 3 times" in caplog.text
    assert alloc_retries(torch.device("cpu")) == 0


def test_a_step_reads_back_three_values_whatever_its_samples(tiny_model, monkeypatch):
    """On a GPU every value read back waits for the queued kernels: the
    step's own code reads its loss, its gradient norm and its off-policy
    sums once each, however many samples and micro-batches it has (it read
    four sums per sample, so the CPU could not run ahead of the GPU)."""
    policy = ReferencePolicy(PolicyConfig(pretrain=tiny_model, micro_batch_tokens=16))
    made = groups()
    for group in made:
        for sample in group.samples:
            sample.logprobs = [-1.0] * len(sample.completion_token_ids)
    reads = []
    for name in ("__float__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("training."):
                reads.append(caller)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    report = policy.train_step(made)
    assert report.trained_samples == 8 and report.logprob_mismatch is not None
    assert len(reads) == 3, reads
