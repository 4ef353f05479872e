"""Rows to rollout groups, and the masked multi-turn sample."""

from __future__ import annotations

import pytest

from training.rollouts import RolloutSample, groups_from_rows


def row(prompt_index: int, sample_index: int, **extra) -> dict:
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt_token_ids": [1, 2],
        "response_token_ids": [3, 4, 5],
        "response": "abc",
        "logprobs": [-0.5, 0.0, -0.5],
        "weight_version": 4,
        "reward": 1.0,
        **extra,
    }


def test_groups_carry_the_mask_and_versions_of_multi_turn_rows():
    rows = [
        row(1, 0, loss_mask=[1, 0, 1], token_versions=[3, -1, 4]),
        row(0, 1),
        row(0, 0, loss_mask=None, token_versions=None),
    ]
    first, second = groups_from_rows(rows)
    assert [s.loss_mask for s in first.samples] == [None, None]
    assert [s.mask for s in first.samples] == [[1, 1, 1], [1, 1, 1]]
    (multi,) = second.samples
    assert multi.loss_mask == [1, 0, 1] and multi.token_versions == [3, -1, 4]
    assert multi.sampled_tokens == 2
    # The environment token's NOT_SAMPLED is no version.
    assert multi.oldest_version == 3 and first.samples[0].oldest_version == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss_mask": [1, 0]}, "2 loss_mask entries for 3 tokens"),
        ({"token_versions": [1]}, "1 token_versions entries for 3 tokens"),
        ({"loss_mask": [1, 2, 0]}, "other than 0 and 1"),
    ],
)
def test_misaligned_columns_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutSample(
            prompt_token_ids=[1], completion_token_ids=[3, 4, 5], weight_version=0, **fields
        )
