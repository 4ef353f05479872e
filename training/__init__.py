"""The trainer side of on-policy RL: the `Trainer` interface users implement,
a reference policy (GRPO-style step on a transformers model, runnable as a Ray
actor), rollout records and reward functions loaded by import path."""

from training.config import PolicyConfig
from training.rewards import load_reward
from training.rollouts import (
    RolloutGroup,
    RolloutSample,
    StaleRolloutError,
    groups_from_rows,
)
from training.trainer import Trainer

__all__ = [
    "PolicyConfig",
    "RolloutGroup",
    "RolloutSample",
    "StaleRolloutError",
    "Trainer",
    "groups_from_rows",
    "load_reward",
]
