"""The trajectory builder, pure: turns in, exact samples out (no HTTP)."""

from __future__ import annotations

import pytest

from agents.router.turns import (
    Mismatch,
    SampledTurn,
    TrajectoryBuilder,
    TurnParseError,
    describe_split,
    parse_turn,
)
from engines.trajectory import NOT_SAMPLED


def turn(prompt, ids, version=1, engine="e0"):
    return SampledTurn(
        prompt_token_ids=list(prompt),
        token_ids=list(ids),
        logprobs=[-0.5 - i for i in range(len(ids))],
        token_versions=[version] * len(ids),
        engine=engine,
    )


def test_append_only_turns_make_one_sample_of_sampled_and_environment_ids():
    builder = TrajectoryBuilder()
    builder.add_turn(turn([1, 2, 3], [10, 11], version=3))
    # turn 2's prompt: the stream so far, then a tool result and the template's tokens
    builder.add_turn(turn([1, 2, 3, 10, 11, 20, 21, 22], [12], version=4, engine="e1"))
    builder.add_turn(turn([1, 2, 3, 10, 11, 20, 21, 22, 12], [13, 14], version=4))

    [sample] = builder.samples()
    assert sample.prompt_token_ids == [1, 2, 3]
    assert sample.response_token_ids == [10, 11, 20, 21, 22, 12, 13, 14]
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1, 1, 1]
    assert sample.token_versions == [3, 3, NOT_SAMPLED, NOT_SAMPLED, NOT_SAMPLED, 4, 4, 4]
    assert sample.logprobs == [-0.5, -1.5, 0.0, 0.0, 0.0, -0.5, -0.5, -1.5]
    assert sample.sampled_token_ids == [10, 11, 12, 13, 14]
    # a turn with no tokens between (turn 3) adds no environment span
    assert [(t.role, t.start, t.stop, t.engine) for t in sample.turns] == [
        ("assistant", 0, 2, "e0"),
        ("environment", 2, 5, None),
        ("assistant", 5, 6, "e1"),
        ("assistant", 6, 8, "e0"),
    ]
    assert sample.split_reason is None


def test_a_prompt_that_rewrites_history_splits_with_its_reason():
    builder = TrajectoryBuilder()
    builder.add_turn(turn([1, 2], [7, 8, 9]))
    rewritten = [1, 2, 9, 30]  # the template dropped 7, 8 (a think block)
    found = builder.mismatch(rewritten)
    assert found == Mismatch(position=2, stream_token=7, prompt_token=9)
    reason = describe_split(2, found, "<think>", "</think>")
    builder.add_turn(turn(rewritten, [5]), reason)

    first, second = builder.samples()
    assert first.response_token_ids == [7, 8, 9] and first.split_reason is None
    assert second.prompt_token_ids == rewritten
    assert second.response_token_ids == [5] and second.loss_mask == [1]
    assert second.split_reason == reason
    assert "turn 2" in reason and "position 2" in reason
    assert "7 '<think>'" in reason and "9 '</think>'" in reason


def test_a_prompt_shorter_than_the_stream_splits_and_says_it_ended():
    builder = TrajectoryBuilder()
    builder.add_turn(turn([1, 2], [7]))
    found = builder.mismatch([1, 2])
    assert found == Mismatch(position=2, stream_token=7, prompt_token=None)
    assert "the prompt has end" in describe_split(2, found, "x", None)


def test_a_split_without_a_reason_is_refused():
    builder = TrajectoryBuilder()
    builder.add_turn(turn([1, 2], [7]))
    with pytest.raises(ValueError, match="turn 2 leaves the stream"):
        builder.add_turn(turn([1, 3], [7]))


def test_a_misaligned_turn_is_refused():
    with pytest.raises(TurnParseError, match="2 sampled ids, 1 logprobs"):
        SampledTurn([1], [2, 3], [-1.0], [0, 0], "e0")


def chat_body(**choice):
    return {
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "token_ids": [5, 6],
                "logprobs": {"content": [{"logprob": -0.25}, {"logprob": -1.0}]},
                **choice,
            }
        ],
    }


def test_parse_turn_takes_per_token_versions_when_given():
    parsed = parse_turn(chat_body(token_versions=[3, 4]), "chat", "e0", [3, 4])
    assert parsed == SampledTurn([1, 2], [5, 6], [-0.25, -1.0], [3, 4], "e0")


@pytest.mark.parametrize(
    ("body_versions", "header", "expected"),
    [([2], [], [2, 2]), (None, [5], [5, 5]), ([3, 4], [3, 4], [3, 3])],
)
def test_parse_turn_falls_back_to_the_requests_versions(body_versions, header, expected):
    body = chat_body()
    if body_versions is not None:
        body["weight_versions"] = body_versions
    assert parse_turn(body, "chat", "e0", header).token_versions == expected


def test_parse_turn_reads_a_completions_shape():
    body = {
        "choices": [
            {
                "prompt_token_ids": [4],
                "token_ids": [8],
                "logprobs": {"token_logprobs": [-2.0], "tokens": ["x"]},
            }
        ],
        "weight_versions": [0],
    }
    assert parse_turn(body, "completion", "e1", []) == SampledTurn([4], [8], [-2.0], [0], "e1")


def test_parse_turn_names_what_is_missing():
    body = chat_body()
    del body["choices"][0]["token_ids"]
    with pytest.raises(TurnParseError, match="engine e0 returned no token ids"):
        parse_turn(body, "chat", "e0", [1])
    with pytest.raises(TurnParseError, match="named no weight version"):
        parse_turn(chat_body(), "chat", "e0", [])
