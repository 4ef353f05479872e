"""Reward functions, loaded by import path ("package.module:function").

A reward function takes one `RolloutSample` and returns a float. The toy
reward below is what the tests and the demo flow train on: a task a tiny
random model can visibly learn in a few steps.
"""

from __future__ import annotations

import importlib
import string
from collections.abc import Callable

from training.rollouts import RolloutSample

RewardFn = Callable[[RolloutSample], float]

#: The toy task's target: lowercase ASCII letters (26 of the tiny model's 320
#: token ids, so a random policy scores about 0.08 and there is room to learn).
TARGET_CHARS = frozenset(string.ascii_lowercase)


def target_chars_fraction(sample: RolloutSample) -> float:
    """Fraction of generated tokens that are lowercase letters (the byte-level
    tokenizer makes each ASCII character one token). Empty completions score 0."""
    if not sample.completion_token_ids:
        return 0.0
    hits = sum(ch in TARGET_CHARS for ch in sample.completion_text)
    return min(1.0, hits / len(sample.completion_token_ids))


def load_reward(path: str) -> RewardFn:
    """The callable at `path` ("module:attribute")."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"reward must be 'package.module:function', got {path!r}")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {path!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {path!r}: {module_name} has no callable {attr!r}")
    return fn
