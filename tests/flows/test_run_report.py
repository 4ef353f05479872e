"""What a run reports, end to end on the tiny model: per-iteration metrics
in TensorBoard event files (read back with tensorboard's reader), the curves
PNG, the summary artifact with the curves inline, and the progress artifacts."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from rollout_support import run_params, small_run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_rollout_flow import artifacts_of

from flows.rollout import rollout
from tasks.run.loggers import TENSORBOARD_DIR

REWARD = "training.rewards:target_chars_fraction"


def test_on_policy_run_logs_a_point_per_iteration_per_metric(ray_local, tiny_model, tmp_path):
    params = run_params(
        **small_run(
            tiny_model,
            tmp_path,
            iterations=3,
            reward=REWARD,
            learning_rate=0.03,
            n=4,
            logger="tensorboard",
        )
    )
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    run_dir = Path(summary.output_dir)

    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = set(summary.metrics[0].scalars())  # every metric applies to this run
    assert {"reward_mean", "reward_std", "sync_seconds", "tokens_per_s"} <= expected
    assert tags == {f"rollout/{name}" for name in expected}
    for tag in tags:
        assert [e.step for e in events.Scalars(tag)] == [0, 1, 2], tag
    logged = [e.value for e in events.Scalars("rollout/reward_mean")]
    assert logged == pytest.approx([m.reward_mean for m in summary.metrics], abs=1e-6)
    assert [e.value for e in events.Scalars("rollout/rows")] == [32 * 4] * 3

    assert summary.curves == str(run_dir / "curves.png")
    with Image.open(summary.curves) as image:
        assert image.format == "PNG"

    artifacts = artifacts_of(state.state_details.flow_run_id)
    (markdown,) = artifacts["markdown"]
    assert "data:image/png;base64," in markdown.data
    progress = artifacts["progress"]
    assert [a.data for a in progress] == [100.0] * 3
    assert [a.description.split(",")[0] for a in progress] == [
        f"Iteration {i}: 128/128 rows" for i in range(3)
    ]
