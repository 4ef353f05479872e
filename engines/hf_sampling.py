"""Token sampling for the CPU backend, honouring every SamplingParams field.

Logprobs are those of the model's raw distribution (before temperature, top-k
and top-p), as vLLM returns them by default.
"""

from __future__ import annotations

import torch

from engines.sampling import SamplingParams


def logprob_entry(logprobs: torch.Tensor, token: int, top: int) -> dict[int, float]:
    """The sampled token's logprob plus the `top` most likely ones."""
    entry = {token: float(logprobs[token])}
    if top > 0:
        values, indices = torch.topk(logprobs, top)
        for value, index in zip(values.tolist(), indices.tolist(), strict=True):
            entry.setdefault(index, value)
    return entry


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    *,
    banned: list[int],
) -> int:
    """One token from a row of logits (float32, [vocab])."""
    logits = logits.clone()
    if banned:
        logits[banned] = float("-inf")
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
