"""A sample in segments, as plain data: the next segment's prompt and
sampling, what an answer appends, the group as one output row set, and the
carry's JSON round trip."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from engines.outputs import CompletionOutput, Logprob, RequestOutput
from engines.sampling import SamplingParams
from tasks.partial.segments import CarryStore, GroupState, SampleState, dumps, segment_seed
from tasks.run.records import rows_for

SAMPLING = SamplingParams(n=4, max_tokens=10, min_tokens=3, temperature=1.0, logprobs=0)


def answer(tokens, versions, reason, engine="e0", admitted=0):
    logprobs = [{t: Logprob(-0.5 - i)} for i, t in enumerate(tokens)]
    sample = CompletionOutput(0, tokens, "x" * len(tokens), reason, logprobs, -1.0, None, versions)
    versions_run = sorted(set(versions)) or [admitted]
    output = RequestOutput("r", [7, 8], [sample], versions_run[0], engine, versions_run)
    return output, sample


def test_a_resumed_segment_sends_the_prompt_and_tokens_with_the_budget_left():
    sample = SampleState(index=2, budget=10)
    first = sample.request(SAMPLING, seed=5)
    assert (first.n, first.max_tokens, first.min_tokens) == (1, 10, 3)
    assert first.seed == segment_seed(5, 2, 0)
    sample.absorb(*answer([1, 2, 3, 4], [0, 0, 0, 0], "abort"))
    assert not sample.done and sample.prompt() == [7, 8, 1, 2, 3, 4]
    second = sample.request(SAMPLING, seed=5)
    assert (second.max_tokens, second.min_tokens) == (6, 0)
    assert second.seed == segment_seed(5, 2, 4) != first.seed
    sample.absorb(*answer([5, 6, 7, 8, 9, 10], [1] * 6, "length", engine="e1"))
    assert sample.done and sample.token_ids == list(range(1, 11))
    assert sample.token_versions == [0] * 4 + [1] * 6
    assert sample.versions == [0, 1] and sample.engines == ["e0", "e1"]
    assert [p[0][1] for p in sample.positions] == [-0.5, -1.5, -2.5, -3.5] + [
        -0.5 - i for i in range(6)
    ]


def test_a_group_makes_rows_with_per_token_versions_and_behaviour_logprobs():
    samples = [SampleState(index=k, budget=4) for k in range(2)]
    samples[0].absorb(*answer([1, 2], [0, 0], "abort"))
    samples[0].absorb(*answer([3, 4], [1, 1], "length", engine="e1"))
    samples[1].absorb(*answer([5, 6, 7], [1, 1, 1], "stop", engine="e1", admitted=1))
    group = GroupState(origin=0, slot=3, prompt_index=1, seed=9, samples=samples)
    assert group.complete
    rows = rows_for(
        group.output("g"), iteration=1, prompt_index=0, prompt="p", seed=9, with_logprobs=True
    )
    assert [r["token_versions"] for r in rows] == [[0, 0, 1, 1], [1, 1, 1]]
    assert [r["response_token_ids"] for r in rows] == [[1, 2, 3, 4], [5, 6, 7]]
    assert rows[0]["logprobs"] == [-0.5, -1.5, -0.5, -1.5]
    assert rows[0]["weight_version"] == 0 and rows[0]["weight_versions"] == [0, 1]
    assert rows[0]["engine"] == "e0,e1"
    again = GroupState.from_json(json.loads(json.dumps(group.to_json())))
    assert again == group
    # The carry's shape is dataclasses' own (carries written before the
    # shallow `to_json` load the same), with nothing copied.
    assert group.to_json() == asdict(group)
    assert group.to_json()["samples"][0]["positions"] is samples[0].positions


def test_a_group_with_an_unfinished_sample_is_not_complete():
    samples = [SampleState(index=0, budget=4), SampleState(index=1, budget=4)]
    samples[0].absorb(*answer([1, 2, 3, 4], [0] * 4, "length"))
    group = GroupState(origin=0, slot=0, prompt_index=0, seed=1, samples=samples)
    assert not group.complete
    samples[1].absorb(*answer([], [], "abort"))  # aborted before its batch ran
    assert not group.complete and samples[1].prompt() == [7, 8]


@pytest.mark.parametrize(
    "odd",
    [None, "nan", "-inf", "seed"],
    ids=["finite", "nan-logprob", "infinite-cumulative", "seed-past-64-bits"],
)
def test_the_carry_reads_back_as_written(tmp_path, odd):
    """The carry is written with orjson; what orjson cannot write as `json`
    reads it back (a non-finite logprob, an integer past 64 bits) goes
    through `json`, so every carry loads as the groups it was written from."""
    sample = SampleState(index=0, budget=8)
    sample.absorb(*answer([1, 2, 3], [0, 0, 0], "abort"))
    group = GroupState(origin=0, slot=0, prompt_index=0, seed=9, samples=[sample])
    if odd == "nan":
        sample.positions[1][0][1] = math.nan
    elif odd == "-inf":
        sample.cumulative = -math.inf
    elif odd == "seed":
        group.seed = 2**70
    assert sample.finite() == (odd not in ("nan", "-inf"))
    store = CarryStore(tmp_path)
    store.write(0, [group])
    (again,) = store.load(0)
    assert json.loads(dumps([group])) == json.loads(json.dumps([group.to_json()]))
    if odd == "nan":  # NaN equals nothing: compare the rest, and that it is NaN
        assert math.isnan(again.samples[0].positions[1][0][1])
        again.samples[0].positions[1][0][1] = sample.positions[1][0][1] = 0.0
    assert again == group
