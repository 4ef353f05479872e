"""What a policy step trains on with dynamic sampling (no Ray): the groups
with signal, one per prompt and round."""

from __future__ import annotations

from tasks.train import trained_rows
from training.rollouts import groups_from_rows


def row(prompt: int, sample: int, round_: int, filtered: bool | None, reward: float) -> dict:
    return {
        "prompt_index": prompt,
        "sample_index": sample,
        "refill_round": round_,
        "filtered": filtered,
        "prompt_token_ids": [1, 2],
        "response_token_ids": [3],
        "weight_version": 0,
        "reward": reward,
    }


def test_filtered_groups_are_left_out_and_rounds_stay_apart():
    rows = [
        row(0, 0, 0, False, 0.0),
        row(0, 1, 0, False, 1.0),
        row(1, 0, 0, True, 1.0),
        row(1, 1, 0, True, 1.0),
        row(0, 0, 1, False, 1.0),  # prompt 0 again, in a refill round
        row(0, 1, 1, False, 0.0),
    ]
    groups = groups_from_rows(trained_rows(rows))
    assert [g.rewards for g in groups] == [[0.0, 1.0], [1.0, 0.0]]


def test_without_any_signal_the_step_gets_the_iterations_own_rows():
    rows = [row(0, s, r, True, 1.0) for r in (0, 1) for s in (0, 1)]
    assert trained_rows(rows) == rows[:2]


def test_without_dynamic_sampling_every_row_is_trained_on():
    rows = [row(0, s, 0, None, 1.0) for s in (0, 1)]
    assert trained_rows(rows) == rows
