"""A micro-batch's loss from its rollout samples, against each sample's own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from training.grpo import clipped_loss, k3_kl, token_logprobs, truncated_is_weights
from training.loss import OffPolicyStats, micro_batch_loss
from training.rollouts import RolloutSample

ARGS = {"clip_eps": 0.2, "tis_cap": 1.5}

#: A two-turn response stream: sampled, environment, sampled (mask 1, 0, 1).
STREAM = [40, 41, 42, 90, 91, 92, 93, 50, 51]
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1]


def load(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_tokens_outside_the_loss_mask_get_no_gradient(tiny_model):
    """The environment's tokens are context: the loss has no gradient at the
    positions that predict them, and does at the sampled ones."""
    model = load(tiny_model)
    prompt = [5, 6, 7]
    sample = RolloutSample(
        prompt_token_ids=prompt,
        completion_token_ids=STREAM,
        logprobs=[-1.0 if m else 0.0 for m in MASK],
        loss_mask=MASK,
        weight_version=0,
    )
    with torch.no_grad():
        logprobs = token_logprobs(model, [prompt + STREAM])
    logprobs.requires_grad_(True)
    loss = micro_batch_loss([(sample, 1.0)], logprobs, **ARGS, off_policy=OffPolicyStats())
    loss.sum().backward()
    response_grad = logprobs.grad[0, len(prompt) - 1 :]
    for grad, m in zip(response_grad, MASK, strict=True):
        assert (grad != 0) == bool(m), response_grad


def test_a_micro_batch_loss_is_each_samples_own(tiny_model):
    """Padded into one micro-batch, samples of other lengths, masks, with
    and without behaviour logprobs, get the loss, gradient and off-policy
    sums they get one at a time (the clipped loss over a sample's sampled
    tokens, its IS weights from its own behaviour logprobs)."""
    model = load(tiny_model)
    torch.manual_seed(0)
    # prompt, completion, loss mask, behaviour logprobs, advantage
    shapes = [
        ([5, 6, 7], STREAM, MASK, True, 1.5),
        ([8], [40, 41], None, False, -0.7),
        ([9, 9], [42], None, True, 0.3),
    ]
    trained = [
        (
            RolloutSample(
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                logprobs=(torch.rand(len(completion)) * 3 - 8).tolist() if behaviour else None,
                loss_mask=mask,
                weight_version=0,
            ),
            advantage,
        )
        for prompt, completion, mask, behaviour, advantage in shapes
    ]
    sequences = [s.prompt_token_ids + s.completion_token_ids for s, _ in trained]
    with torch.no_grad():
        padded = token_logprobs(model, sequences)
    padded.requires_grad_(True)
    batched_stats = OffPolicyStats()
    batched = micro_batch_loss(trained, padded, **ARGS, off_policy=batched_stats)
    batched.sum().backward()

    alone_stats = {"tokens": 0, "abs_diff": 0.0, "kl": 0.0, "weights": 0.0, "truncated": 0}
    for row, ((sample, advantage), seq) in enumerate(zip(trained, sequences, strict=True)):
        new = padded.detach()[row, len(sample.prompt_token_ids) - 1 : len(seq) - 1].clone()
        new.requires_grad_(True)
        keep = torch.tensor(sample.mask, dtype=torch.bool)
        weight = None
        if sample.logprobs is not None:
            behaviour = torch.tensor(sample.logprobs)[keep]
            weight = truncated_is_weights(new.detach()[keep], behaviour, ARGS["tis_cap"])
            alone_stats["tokens"] += int(keep.sum())
            alone_stats["abs_diff"] += float((new.detach()[keep] - behaviour).abs().sum())
            alone_stats["kl"] += float(k3_kl(new.detach()[keep], behaviour).sum())
            alone_stats["weights"] += float(weight.sum())
            alone_stats["truncated"] += int((weight >= ARGS["tis_cap"]).sum())
        loss = clipped_loss(new[keep], new.detach()[keep], advantage, ARGS["clip_eps"], weight)
        loss.backward()
        torch.testing.assert_close(batched[row], loss.detach())
        start = len(sample.prompt_token_ids) - 1
        torch.testing.assert_close(padded.grad[row, start : len(seq) - 1], new.grad)
        assert torch.all(padded.grad[row, len(seq) - 1 :] == 0)  # padding
        assert torch.all(padded.grad[row, :start] == 0)  # the prompt
    assert alone_stats["truncated"] > 0  # the cap was reached
    got = dict(zip(OffPolicyStats.NAMES, batched_stats.sums.tolist(), strict=True))
    assert got == pytest.approx(alone_stats, rel=1e-5)
