"""The reference policy's train step."""

from __future__ import annotations

import pytest
import torch

from training.config import PolicyConfig
from training.policy import ReferencePolicy
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
    assert abs(a.loss - b.loss) < 1e-6 and abs(a.grad_norm - b.grad_norm) < 1e-5
    for (name, p), (_, q) in zip(
        whole.model.named_parameters(), split.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


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
