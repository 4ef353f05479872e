"""The CPU backend's sampling functions (engines/hf/sampling.py), on plain
tensors: penalties, min-p, banned tokens and greedy."""

from __future__ import annotations

import torch

from engines.hf.sampling import processed_logits
from engines.sampling import SamplingParams


def test_penalties_min_p_and_max_tokens_none():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = processed_logits(logits, params, banned=[], prompt=[0], output=[1, 1])
    # token 0 (prompt): 2/2; token 1 (output twice): -1*2 - 0.5*2 - 0.25
    torch.testing.assert_close(out, torch.tensor([1.0, -3.25, 0.5, 0.0]))
    only_top = processed_logits(logits, SamplingParams(min_p=0.5), banned=[], prompt=[], output=[])
    assert torch.isfinite(only_top).tolist() == [True, False, False, False]
    greedy = processed_logits(
        logits, SamplingParams(temperature=0.0, min_p=0.5), banned=[2], prompt=[], output=[]
    )
    assert greedy.tolist()[:2] == [2.0, -1.0] and greedy[2] == float("-inf")
