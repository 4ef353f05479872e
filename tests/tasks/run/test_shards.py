"""Shards: planned to cover every prompt once, written atomically (with the
input's id, label and metadata columns), read as they are by pandas and
`datasets`, reused only when made from the same inputs."""

from __future__ import annotations

import json
import os

import pytest

from engines.outputs import CompletionOutput, Logprob, RequestOutput
from tasks.run.prompts import PromptRecord, column_types
from tasks.run.records import rows_for, with_input
from tasks.run.shards import (
    OutputMismatchError,
    Shard,
    ShardStore,
    plan_shards,
    prepare_run_dir,
    read_rows,
)


@pytest.mark.parametrize(("prompts", "size"), [(1, 1), (10, 3), (32, 16), (5, 100)])
def test_plan_covers_every_prompt_once(prompts, size):
    shards = plan_shards(prompts, size)
    covered = [i for shard in shards for i in range(shard.start, shard.stop)]
    assert covered == list(range(prompts))
    assert [s.index for s in shards] == list(range(len(shards)))
    assert all(0 < len(s) <= size for s in shards)


def sample_rows(shard: Shard) -> list[dict]:
    output = RequestOutput(
        request_id="r",
        prompt_token_ids=[1, 2],
        outputs=[
            CompletionOutput(
                index=0,
                token_ids=[5, 6],
                text="hi",
                finish_reason="length",
                logprobs=[
                    {5: Logprob(-0.5), 9: Logprob(-1.0)},
                    {6: Logprob(-0.25), 7: Logprob(-0.1)},
                ],
                cumulative_logprob=-0.75,
            )
        ],
        weight_version=3,
        engine="e-0",
    )
    return [
        row
        for i in range(shard.start, shard.stop)
        for row in rows_for(
            output, iteration=0, prompt_index=i, prompt=f"p{i}", seed=100 + i, with_logprobs=True
        )
    ]


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_write_then_read_back(tmp_path, output_format):
    store = ShardStore(tmp_path / "iter-000", output_format)
    shards = plan_shards(5, 2)
    assert not any(store.is_done(s) for s in shards)
    for shard in shards[:2]:
        store.write(shard, sample_rows(shard))
    assert [store.is_done(s) for s in shards] == [True, True, False]
    # counted as written, not n per prompt (an agent's split session writes more)
    store.write(shards[1], sample_rows(shards[1]) * 3)
    assert [store.count_rows(s) for s in shards[:2]] == [2, 6]
    store.write(shards[1], sample_rows(shards[1]))
    rows = read_rows(tmp_path / "iter-000")
    assert [r["prompt_index"] for r in rows] == [0, 1, 2, 3]
    first = rows[0]
    assert first["seed"] == 100
    assert first["weight_version"] == 3
    assert first["logprobs"] == [-0.5, -0.25]
    assert first["top_logprobs"][1] == [
        {"token_id": 7, "logprob": -0.1},
        {"token_id": 6, "logprob": -0.25},
    ]
    assert not list((tmp_path / "iter-000").glob(".*"))  # no temporary file left


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_responses_with_unicode_line_separators_read_back(tmp_path, output_format):
    """A random or real model may emit U+2028, U+0085 or U+001C, which JSON
    leaves unescaped (or escapes) but str.splitlines treats as line ends."""
    store = ShardStore(tmp_path, output_format)
    (shard,) = plan_shards(1, 1)
    text = "a\u2028b\u2029c\x85d\x1ce\rf\ng"
    rows = [{**row, "response": text} for row in sample_rows(shard)]
    store.write(shard, rows)
    assert [row["response"] for row in read_rows(tmp_path)] == [text] * len(rows)


def test_partial_files_of_a_killed_attempt_are_removed(tmp_path):
    store = ShardStore(tmp_path, "jsonl")
    partial = tmp_path / ".shard-00000.jsonl.1234abcd.tmp"
    partial.write_text('{"half": ')
    assert not store.is_done(Shard(0, 0, 1))
    store.remove_partial_files()
    assert not partial.exists()


def test_a_failed_write_leaves_no_shard(tmp_path):
    store = ShardStore(tmp_path, "jsonl")
    shard = Shard(0, 0, 2)
    circular: dict = {}
    circular["self"] = circular
    rows = sample_rows(shard) + [{"not serialisable": circular}]
    with pytest.raises(ValueError, match="Circular reference"):
        store.write(shard, rows)
    assert not store.is_done(shard)
    assert os.listdir(tmp_path) == []


def test_run_dir_reused_only_with_the_same_inputs(tmp_path):
    manifest = {"prompts_sha256": "abc", "seed": 1}
    run_dir = prepare_run_dir(tmp_path / "run", manifest)
    assert json.loads((run_dir / "run.json").read_text()) == manifest
    assert prepare_run_dir(tmp_path / "run", dict(manifest)) == run_dir
    with pytest.raises(OutputMismatchError, match=r"was \{'seed': 1\}, now \{'seed': 2\}"):
        prepare_run_dir(tmp_path / "run", {**manifest, "seed": 2})


RECORDS = [
    PromptRecord(id="q-0", prompt="p0", label="4", metadata={"src": "gsm8k", "x": 1}),
    PromptRecord(id="q-1", prompt="p1", label="5", metadata={"src": "math", "x": "two"}),
]


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_rows_carry_id_label_metadata_and_reward(tmp_path, output_format):
    store = ShardStore(tmp_path, output_format, column_types(RECORDS))
    shard = Shard(0, 0, 2)
    rows = []
    for row, record in zip(sample_rows(shard), RECORDS, strict=True):
        rows.append({**with_input(row, record), "reward": 1.0, "advantage": -0.5})
    store.write(shard, rows)
    (first, second) = read_rows(tmp_path)
    assert (first["id"], first["label"], first["src"]) == ("q-0", "4", "gsm8k")
    assert (second["reward"], second["advantage"]) == (1.0, -0.5)
    # `x` has no common type: JSON text in Parquet, as it is in JSONL.
    assert [first["x"], second["x"]] == ([1, "two"] if output_format == "jsonl" else ["1", '"two"'])


def test_parquet_shards_read_with_pandas_and_datasets(tmp_path):
    pandas = pytest.importorskip("pandas")
    datasets = pytest.importorskip("datasets")
    store = ShardStore(tmp_path / "iter-000", "parquet", column_types(RECORDS))
    for shard in plan_shards(2, 1):
        rows = [with_input(r, RECORDS[shard.start]) for r in sample_rows(shard)]
        store.write(shard, rows)
    frame = pandas.read_parquet(tmp_path / "iter-000")
    assert frame["id"].tolist() == ["q-0", "q-1"]
    assert frame["label"].tolist() == ["4", "5"]
    loaded = datasets.load_dataset(
        "parquet",
        data_files=str(tmp_path / "iter-*" / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert loaded["src"] == ["gsm8k", "math"]
    assert loaded["prompt_index"] == [0, 1]


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_refill_rounds_are_shards_of_their_own_read_back_by_column(tmp_path, output_format):
    store = ShardStore(tmp_path / "iter-000", output_format)
    first, refill = plan_shards(2, 2)[0], plan_shards(1, 2, round=1)[0]
    assert (first.index, refill.index, refill.round) == (0, 0, 1)
    store.write(first, sample_rows(first))
    assert not store.is_done(refill)  # the same index in another round
    rows = sample_rows(refill)
    for row in rows:
        row.update(refill_round=1, filtered=True)
    store.write(refill, rows)
    assert store.path(refill).name == f"shard-r01-00000.{output_format}"
    assert store.read(refill, ["prompt_index", "filtered"]) == [
        {"prompt_index": 0, "filtered": True}
    ]
    # Read with the iteration, after its own shards.
    assert [r["refill_round"] for r in read_rows(tmp_path / "iter-000")] == [0, 0, 1]
