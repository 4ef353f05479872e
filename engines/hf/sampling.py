"""Token sampling for the CPU backend, honouring every SamplingParams field.

Logprobs are those of the model's raw distribution (before temperature, top-k
and top-p), as vLLM returns them by default, or with `logprobs_mode=
"processed_logprobs"` those of the distribution sampled from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.outputs import Logprob
from engines.sampling import SamplingParams


def logprob_entry(
    logprobs: torch.Tensor, token: int, top: int, decode: Callable[[int], str]
) -> dict[int, Logprob]:
    """The sampled token's Logprob plus the `top` most likely ones, ranked
    in the vocabulary as vLLM ranks them (1 is the most likely)."""
    value = logprobs[token]
    rank = int((logprobs > value).sum()) + 1
    entry = {token: Logprob(float(value), rank, decode(token))}
    if top > 0:
        values, indices = torch.topk(logprobs, top)
        for k, (value, index) in enumerate(zip(values.tolist(), indices.tolist(), strict=True)):
            if index not in entry:
                entry[index] = Logprob(value, k + 1, decode(index))
    return entry


def processed_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    banned: list[int],
    prompt: list[int],
    output: list[int],
) -> torch.Tensor:
    """The logits a token is sampled from (float32, [vocab]), in vLLM's order:
    banned tokens, penalties, then (unless greedy) temperature, min-p, top-k
    and top-p."""
    logits = logits.clone()
    if banned:
        logits[banned] = float("-inf")
    apply_penalties(logits, params, prompt, output)
    if params.temperature == 0.0:
        return logits
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits[probs < params.min_p * probs.max()] = float("-inf")
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        logits[order[drop]] = float("-inf")
    return logits


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> None:
    """vLLM's: repetition over prompt and output tokens (divide positive
    logits, multiply negative ones), frequency and presence over the output."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output), minlength=logits.numel())[: logits.numel()]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text`: (where it starts, which)."""
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found) if found else None


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from processed logits (see `processed_logits`)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
