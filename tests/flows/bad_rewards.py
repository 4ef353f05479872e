"""Rewards that break, for the flow tests (loaded from this file by the
reward actor: `<path of this file>:<name>`)."""

from __future__ import annotations

import math


def raises(samples):
    raise RuntimeError("verifier down")


def nan_for_one(samples):
    return [math.nan if (s.id, s.sample) == ("letter-0003", 1) else 0.0 for s in samples]


def one_short(samples):
    return [0.0] * (len(samples) - 1)


def slow(samples):
    import time

    time.sleep(60)
    return [0.0] * len(samples)
