"""The math of a GRPO-style update: group-relative advantages, per-token
logprobs under the policy, and the clipped policy-gradient loss. Pure
functions over torch tensors (torch imported by the caller's process)."""

from __future__ import annotations

import math
from typing import Any


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / std within one prompt's samples; all zero when the
    samples tie (no signal, no update)."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < eps:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def token_logprobs(model: Any, sequences: list[list[int]], pad_id: int = 0) -> Any:
    """The logprob of each token given its prefix, with grad, as one
    (sequences, longest - 1) tensor: row i's first len(sequences[i]) - 1
    entries are its tokens 1..n-1 (position t's logits predict token t+1),
    the rest padding. Right padding: real tokens keep positions 0..n-1, as in
    an unpadded forward."""
    import torch

    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    real = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        real[i, : len(seq)] = True
    real = real.to(device)
    mask = real.long()
    if _own_mask(model):
        # Given a batch without padding, transformers hands SDPA no mask and
        # `enable_gqa`, which only the flash kernel runs fused, in half
        # precision only: a float32 GQA policy's long samples, alone in their
        # micro-batches, fell back to the math kernel (S x S scores in
        # memory). A 4D causal and padding mask (True: attend, as SDPA reads
        # it), which transformers takes as is, gives every micro-batch the
        # memory-efficient kernel the padded ones got.
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        mask = (causal & real[:, None, :])[:, None]
    logits = model(input_ids=ids.to(device), attention_mask=mask).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return logprobs.gather(-1, ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)


def _own_mask(model: Any) -> bool:
    """Whether `token_logprobs` passes its own 4D mask: a model computing in
    float32 (not under a half-precision autocast, whose attention flash
    runs) on SDPA with full attention in every layer. Eager attention adds
    a 4D mask to its scores (a boolean one would mask nothing), and a
    prepared mask would stand for sliding windows too: those keep
    transformers' own."""
    import torch

    config = model.config
    layers = set(getattr(config, "layer_types", None) or ["full_attention"])
    weights = next(model.parameters())
    device = weights.device.type
    autocast = torch.is_autocast_enabled(device)
    return (
        (torch.get_autocast_dtype(device) if autocast else weights.dtype) == torch.float32
        and config._attn_implementation == "sdpa"
        and getattr(config, "sliding_window", None) is None
        and layers == {"full_attention"}
    )


def micro_batches(sequences: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of `sequences` in groups whose padded size (count x longest)
    stays within `max_tokens`; a longer sequence goes alone. Packed in order
    of length, so a long sample pads long neighbours only: in a long-tailed
    batch, kept in arrival order, every 2,048-token sample would pad the
    short ones beside it to its length. The loss is a sum over samples, so
    the grouping does not change it."""
    batches: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(sequences)), key=lambda k: len(sequences[k])):
        width = max(longest, len(sequences[i]))
        if batches and width * (len(batches[-1]) + 1) <= max_tokens:
            batches[-1].append(i)
            longest = width
        else:
            batches.append([i])
            longest = len(sequences[i])
    return batches


def clipped_loss(
    new: Any, old: Any, advantage: Any, clip_eps: float, weight: Any = None, mask: Any = None
) -> Any:
    """PPO's clipped surrogate averaged over a sample's tokens, each token's
    term times `weight` (none: 1). Over the last dimension: a 1-D sample
    gives a scalar; a (samples, tokens) batch gives one loss per sample,
    averaged over the tokens where `mask` holds (`advantage` then one per
    sample, shaped (samples, 1)). With `old == new.detach()` (strictly
    on-policy) it is REINFORCE with a baseline."""
    import torch

    ratio = torch.exp(new - old)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantage
    surrogate = torch.minimum(unclipped, clipped)
    if weight is not None:
        surrogate = surrogate * weight
    if mask is None:
        return -surrogate.mean(-1)
    # where, not a product: a padded position's value never reaches the sum
    # or its gradient.
    return -torch.where(mask, surrogate, 0.0).sum(-1) / mask.sum(-1)


def truncated_is_weights(proximal: Any, behaviour: Any, cap: float) -> Any:
    """Per token, min(pi_proximal / pi_behaviour, cap), detached: the
    correction of decoupled PPO (AReaL) with truncated importance sampling
    (verl's TIS) for rows sampled by other weights than the policy's (an
    older version, or the engine's numerics)."""
    import torch

    return torch.exp(proximal.detach() - behaviour).clamp(max=cap)


def k3_kl(proximal: Any, behaviour: Any) -> Any:
    """Per token, Schulman's k3 estimate of KL(behaviour || proximal) from
    tokens the behaviour policy sampled: e^r - 1 - r, r = log(pi_prox / pi_beh).
    Never negative, unbiased."""
    import torch

    log_ratio = proximal.detach() - behaviour
    return torch.exp(log_ratio) - 1.0 - log_ratio
