"""Rewards that break, for the flow tests (imported by path in the reward
actor: `tests.flows.bad_rewards:<name>`, from the repository root)."""

from __future__ import annotations

import math


def raises(samples):
    raise RuntimeError("verifier down")


def nan_for_one(samples):
    return [math.nan if (s.id, s.sample) == ("letter-0003", 1) else 0.0 for s in samples]


def one_short(samples):
    return [0.0] * (len(samples) - 1)
