"""The GRPO-style math: advantages, per-token logprobs, the clipped loss."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from training.grpo import (
    clipped_loss,
    group_advantages,
    k3_kl,
    micro_batches,
    token_logprobs,
    truncated_is_weights,
)


def test_advantages_are_normalised_within_the_group():
    adv = group_advantages([0.0, 1.0, 1.0, 2.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert adv[0] < adv[1] == adv[2] < adv[3]
    std = math.sqrt(sum(a * a for a in adv) / 4)
    assert std == pytest.approx(1.0, abs=1e-5)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at least one"):
        group_advantages([])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_right_padded_logprobs_equal_unpadded_forwards(tiny_model, attention):
    """On SDPA a float32 model gets `token_logprobs`' own 4D mask; eager
    attention, which adds a 4D mask to its scores, keeps transformers' own."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation=attention
    ).eval()
    sequences = [[5, 9, 200, 31, 7, 8], [44, 2, 3]]
    with torch.no_grad():
        batched = token_logprobs(model, sequences, pad_id=0)
        assert batched.shape == (2, 5)
        for seq, row in zip(sequences, batched, strict=True):
            got = row[: len(seq) - 1]
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])
            torch.testing.assert_close(got, expected[:, 0], atol=1e-5, rtol=0)
            # Alone, without padding (a long sample's micro-batch): the same.
            (alone,) = token_logprobs(model, [seq], pad_id=0)
            torch.testing.assert_close(alone, expected[:, 0], atol=1e-5, rtol=0)


def test_under_a_bf16_autocast_transformers_masks_and_flash_may_run(tiny_model):
    """The own 4D mask is for float32 attention, which flash does not run;
    under a bf16 autocast the attention is bf16, and an unpadded batch given
    no mask may take the flash kernel. Padded rows still match their
    unpadded forwards, within bf16's rounding."""
    from training.grpo import _own_mask

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    assert _own_mask(model)
    sequences = [[5, 9, 200, 31, 7, 8], [44, 2, 3]]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _own_mask(model)
        batched = token_logprobs(model, sequences, pad_id=0)
        for seq, row in zip(sequences, batched, strict=True):
            (alone,) = token_logprobs(model, [seq], pad_id=0)
            torch.testing.assert_close(row[: len(seq) - 1], alone, atol=0.05, rtol=0)
    assert _own_mask(model)


def test_loss_pushes_logprobs_along_the_advantage():
    for advantage in (1.0, -1.0):
        logprobs = torch.tensor([-2.0, -1.0], requires_grad=True)
        loss = clipped_loss(logprobs, logprobs.detach(), advantage, clip_eps=0.2)
        loss.backward()
        # Gradient descent raises the logprobs of good samples, lowers bad ones.
        assert torch.all(-logprobs.grad * advantage > 0)


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    old = torch.tensor([-1.0])
    new = torch.tensor([-0.5], requires_grad=True)  # ratio e^0.5 > 1.2
    clipped_loss(new, old, advantage=1.0, clip_eps=0.2).backward()
    assert new.grad.item() == 0.0


def test_truncated_is_weights_are_the_capped_ratio_without_grad():
    proximal = torch.tensor([-1.0, -1.0, -3.0], requires_grad=True)
    behaviour = torch.tensor([-1.0, -2.0, -1.0])
    weights = truncated_is_weights(proximal, behaviour, cap=2.0)
    assert not weights.requires_grad
    # Equal: 1; the policy likes the token e times more: cut at the cap; less: e^-2.
    torch.testing.assert_close(weights, torch.tensor([1.0, 2.0, math.exp(-2.0)]))


def test_k3_is_zero_on_policy_and_positive_off_it():
    behaviour = torch.tensor([-1.0, -2.0])
    assert torch.all(k3_kl(behaviour.clone(), behaviour) == 0)
    shifted = k3_kl(behaviour + torch.tensor([0.5, -0.5]), behaviour)
    assert torch.all(shifted > 0)
    torch.testing.assert_close(shifted[0], torch.tensor(math.exp(0.5) - 1.5))


def test_the_is_weight_scales_each_tokens_gradient():
    """Decoupled PPO: against the proximal (new.detach()) the ratio is 1, so
    each token's gradient is -advantage x its weight / tokens."""
    new = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    weight = torch.tensor([1.0, 0.5, 2.0])
    clipped_loss(new, new.detach(), 1.0, clip_eps=0.2, weight=weight).backward()
    torch.testing.assert_close(new.grad, -weight / 3)
    plain = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    clipped_loss(plain, plain.detach(), 1.0, clip_eps=0.2).backward()
    torch.testing.assert_close(plain.grad, torch.full((3,), -1 / 3))


def test_micro_batches_pack_by_length_within_their_padded_size():
    sequences = [[1] * n for n in (3, 3, 5, 2, 9, 1)]
    # by length: 1, 2, 3, 3 -> 4x3=12 > 10, so 1,2,3 (3x3=9); 3,5 (2x5); 9 alone
    assert micro_batches(sequences, 10) == [[5, 3, 0], [1, 2], [4]]
    assert micro_batches(sequences, 1) == [[5], [3], [0], [1], [2], [4]]  # a longer one alone
    assert sorted(micro_batches(sequences, 10_000)[0]) == list(range(6))


def test_micro_batches_keep_a_long_sample_from_padding_short_ones():
    """A long-tailed batch: in arrival order each long sample would share a
    micro-batch with short ones, padded to its length."""
    lengths = [16, 2048, 40, 2048, 30, 64, 2048, 20]
    batches = micro_batches([[1] * n for n in lengths], 4096)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded == 5 * 64 + 3 * 2048  # the short ones pad to 64, the long ones to themselves
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
