"""Reward loading by import path, the toy reward, and rollout grouping."""

from __future__ import annotations

import pytest

from training.rewards import load_reward, target_chars_fraction
from training.rollouts import RolloutSample, groups_from_rows


def sample(text: str, tokens: int) -> RolloutSample:
    return RolloutSample(
        prompt_token_ids=[1],
        completion_token_ids=list(range(tokens)),
        completion_text=text,
        weight_version=0,
    )


def test_toy_reward_counts_lowercase_letters_per_token():
    assert target_chars_fraction(sample("abcd", 4)) == 1.0
    assert target_chars_fraction(sample("aB1 ", 4)) == 0.25
    # Tokens that decode to nothing (ids outside the byte alphabet) count as misses.
    assert target_chars_fraction(sample("ab", 4)) == 0.5
    assert target_chars_fraction(sample("", 0)) == 0.0


def test_reward_is_loaded_by_import_path():
    assert load_reward("training.rewards:target_chars_fraction") is target_chars_fraction
    with pytest.raises(
        ValueError,
        match="must be 'package.module:function', got 'training.rewards.target_chars_fraction'",
    ):
        load_reward("training.rewards.target_chars_fraction")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_reward("no_such_module:f")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_reward("training.rewards:nope")


def row(prompt_index: int, sample_index: int, text: str, version: int = 3) -> dict:
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt_token_ids": [9, 9],
        "response_token_ids": [1] * len(text),
        "response": text,
        "logprobs": [-1.0] * len(text),
        "weight_version": version,
    }


def test_rows_group_by_prompt_in_sample_order_and_get_scored():
    rows = [row(1, 1, "ab"), row(0, 0, "XY"), row(1, 0, "a1"), row(0, 1, "xy")]
    groups = groups_from_rows(rows, target_chars_fraction)
    assert [[s.completion_text for s in g.samples] for g in groups] == [["XY", "xy"], ["a1", "ab"]]
    assert [g.rewards for g in groups] == [[0.0, 1.0], [0.5, 1.0]]
    assert groups[0].samples[0].weight_version == 3
    with pytest.raises(ValueError, match="no reward"):
        _ = groups_from_rows(rows)[0].rewards
