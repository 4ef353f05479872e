"""The policy a run starts: its config from the run's parameters."""

from __future__ import annotations

import pytest

from flows.params import RolloutParams, sectioned
from flows.side_actors import policy_config

REWARD = "training.letter_task:reward"


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_the_policy_gets_the_runs_step_settings(tiny_model, compute_dtype):
    params = RolloutParams.model_validate(
        sectioned(
            {
                "reward": REWARD,
                "learning_rate": 0.002,
                "micro_batch_tokens": 512,
                "compute_dtype": compute_dtype,
                "max_staleness": 1,
                "schedule": "overlap",
            }
        )
    )
    config = policy_config(params, tiny_model, "hf")
    assert config.compute_dtype == compute_dtype
    assert (config.learning_rate, config.micro_batch_tokens) == (0.002, 512)
    assert (config.device, config.sync_backend, config.max_staleness) == ("cpu", "gloo", 1)
