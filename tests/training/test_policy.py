"""The reference policy's train step."""

from __future__ import annotations

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
