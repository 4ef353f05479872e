"""Rows' multi-turn columns: a single-turn row fills them, an agent
sample's row is its trajectory; both survive a shard's write and read and
train as `groups_from_rows` reads them. A prompt row's own max_tokens sets
its requests' budget."""

from __future__ import annotations

import pytest

from engines.outputs import CompletionOutput, RequestOutput
from engines.sampling import SamplingParams
from engines.trajectory import NOT_SAMPLED, TrajectorySample, TurnSpan
from tasks.run.records import record_sampling, rows_for, trajectory_row
from tasks.run.shards import ShardStore, plan_shards, read_rows
from training.rollouts import groups_from_rows

SAMPLING = SamplingParams(n=4, max_tokens=10, min_tokens=3, temperature=1.0, logprobs=0)


def single_turn_row() -> dict:
    output = RequestOutput(
        request_id="r",
        prompt_token_ids=[1, 2],
        outputs=[CompletionOutput(index=0, token_ids=[5, 6, 7], text="abc", finish_reason="stop")],
        weight_version=3,
        engine="e-0",
    )
    (row,) = rows_for(output, iteration=0, prompt_index=0, prompt="p", seed=1, with_logprobs=False)
    return row


def trajectory() -> TrajectorySample:
    return TrajectorySample(
        prompt_token_ids=[1, 2],
        response_token_ids=[10, 11, 20, 21, 22, 12],
        loss_mask=[1, 1, 0, 0, 0, 1],
        logprobs=[-0.5, -0.25, 0.0, 0.0, 0.0, -1.0],
        token_versions=[4, 4, NOT_SAMPLED, NOT_SAMPLED, NOT_SAMPLED, 5],
        turns=[
            TurnSpan(role="assistant", start=0, stop=2, engine="e-1"),
            TurnSpan(role="environment", start=2, stop=5),
            TurnSpan(role="assistant", start=5, stop=6, engine="e-1"),
        ],
        split_reason="template rewrote history",
    )


def test_a_single_turn_row_is_one_sampled_assistant_turn():
    row = single_turn_row()
    assert row["loss_mask"] == [1, 1, 1] and row["token_versions"] == [3, 3, 3]
    assert row["turns"] == [{"role": "assistant", "start": 0, "stop": 3, "engine": "e-0"}]
    assert row["split_reason"] is None and row["session_id"] is None


def test_an_agent_row_holds_its_trajectory():
    row = trajectory_row(
        trajectory(),
        iteration=2,
        prompt_index=1,
        sample_index=3,
        prompt="p",
        response="ab<tool>c",
        session_id="s-1",
        seed=7,
    )
    assert row["prompt_token_ids"] == [1, 2]
    assert row["response_token_ids"] == [10, 11, 20, 21, 22, 12]
    assert row["loss_mask"] == [1, 1, 0, 0, 0, 1]
    assert row["weight_version"] == 4 and row["weight_versions"] == [4, 5]
    assert [t["role"] for t in row["turns"]] == ["assistant", "environment", "assistant"]
    assert row["split_reason"] == "template rewrote history" and row["session_id"] == "s-1"
    assert row["cumulative_logprob"] == pytest.approx(-1.75)


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_both_kinds_of_rows_round_trip_and_train(tmp_path, output_format):
    agent = trajectory_row(
        trajectory(),
        iteration=0,
        prompt_index=0,
        sample_index=1,
        prompt="p",
        response="x",
        session_id="s-1",
        seed=1,
    )
    rows = [{**single_turn_row(), "reward": 0.0}, {**agent, "reward": 1.0}]
    store = ShardStore(tmp_path / "iter-000", output_format)
    (shard,) = plan_shards(1, 1)
    store.write(shard, rows)
    back = read_rows(tmp_path / "iter-000")
    assert back[1]["turns"] == agent["turns"] and back[1]["loss_mask"] == agent["loss_mask"]
    (group,) = groups_from_rows(back)
    single, multi = group.samples
    assert single.sampled_tokens == 3 and multi.sampled_tokens == 3
    assert multi.oldest_version == 4


def test_a_rows_max_tokens_overrides_the_runs_and_a_bad_one_is_named():
    assert record_sampling(SAMPLING, {"max_tokens": 512}).max_tokens == 512
    assert record_sampling(SAMPLING, {"other": 1}) is SAMPLING
    for bad in (0, "8", True, 2.5):
        with pytest.raises(ValueError, match=f"max_tokens must be an integer >= 1, got {bad!r}"):
            record_sampling(SAMPLING, {"max_tokens": bad})
