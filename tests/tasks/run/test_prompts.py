"""Reading prompts: text or chat messages, labels, ids and metadata from
JSONL, Parquet or a directory of Parquet files; every problem is reported
with its place in the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.run.prompts import PromptFields, PromptsFileError, is_json_text, read_prompts

REPO_PROMPTS = Path(__file__).resolve().parents[3] / "data" / "prompts.jsonl"


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_shipped_prompts_file_reads():
    prompts = read_prompts(REPO_PROMPTS, "prompt")
    assert len(prompts) == 32
    assert all(text.strip() for text in prompts.texts)
    assert len(prompts.sha256) == 64


def test_jsonl_keeps_file_order_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"text": "a", "n": 1}', "", '{"text": "b"}', "   "])
    assert read_prompts(path, "text").texts == ["a", "b"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "ok"}', '{"prompt": "ok"}', '{"prompt": "broken'], "line 3: not valid JSON"),
        (['{"prompt": "ok"}', "", '["a list"]'], "line 3: expected a JSON object, got list"),
        (['{"prompt": "ok"}', '{"text": "x"}'], "line 2: no field 'prompt' (fields: ['text'])"),
        (
            ['{"prompt": 7}'],
            "line 1: field 'prompt' must be a string or a list of chat messages, got int",
        ),
        (['{"prompt": "ok"}', '{"prompt": "  "}'], "line 2: field 'prompt' is empty"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, lines, message):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(PromptsFileError, match=re.escape(f"{path} {message}")):
        read_prompts(path, "prompt")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_fails_clearly(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(PromptsFileError, match=re.escape(f"prompts file {path} holds no prompts")):
        read_prompts(path, "prompt")


def test_missing_file(tmp_path):
    with pytest.raises(PromptsFileError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl", "prompt")


def test_parquet_column(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["a", "b", "c"], "other": [1, 2, 3]}), path)
    assert read_prompts(path, "question").texts == ["a", "b", "c"]
    with pytest.raises(PromptsFileError, match=r"row 0: no field 'prompt' \(fields: \['other'"):
        read_prompts(path, "prompt")


def test_parquet_null_names_the_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", None]}), path)
    with pytest.raises(PromptsFileError, match="row 1: field 'prompt' is null"):
        read_prompts(path, "prompt")


def test_digest_follows_content(tmp_path):
    one = write_lines(tmp_path / "one.jsonl", [json.dumps({"prompt": "a"})])
    two = write_lines(tmp_path / "two.jsonl", [json.dumps({"prompt": "b"})])
    assert read_prompts(one, "prompt").sha256 != read_prompts(two, "prompt").sha256


def chat(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_label_id_and_metadata_travel_with_their_row(tmp_path):
    rows = [
        {"q": "1+1", "answer": "2", "uid": "a", "data_source": "math", "extra": {"k": 1}},
        {"q": "2+2", "answer": "4", "uid": "b", "data_source": "math", "extra": {"k": 2}},
    ]
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in rows])
    prompts = read_prompts(path, PromptFields(prompt="q", label="answer", id="uid"))
    assert [(r.id, r.prompt, r.label) for r in prompts.records] == [
        ("a", "1+1", "2"),
        ("b", "2+2", "4"),
    ]
    assert prompts.records[1].metadata == {"data_source": "math", "extra": {"k": 2}}
    assert prompts.columns.names == ["id", "label", "data_source", "extra"]


def test_without_an_id_field_the_id_is_the_rows_position(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "a"}', '{"prompt": "b"}'])
    assert [r.id for r in read_prompts(path).records] == [0, 1]


def test_verl_layout_nested_label(tmp_path):
    row = {
        "prompt": [{"role": "user", "content": "1+1?"}],
        "data_source": "gsm8k",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 7},
    }
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    fields = PromptFields(prompt="prompt", label="reward_model.ground_truth")
    (record,) = read_prompts(path, fields, chat).records
    assert record.prompt == "<user>1+1?<assistant>"
    assert record.label == "2"
    assert record.metadata["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert record.metadata["extra_info"] == {"index": 7}


def test_chat_template_wraps_a_text_prompt_as_one_user_turn(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "hi"}'])
    assert read_prompts(path, "prompt", chat).texts == ["<user>hi<assistant>"]


def test_directory_of_parquet_files_reads_in_name_order(tmp_path):
    pq.write_table(pa.table({"prompt": ["c"]}), tmp_path / "part-1.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "part-0.parquet")
    prompts = read_prompts(tmp_path, "prompt")
    assert prompts.texts == ["a", "b", "c"]
    assert [r.id for r in prompts.records] == [0, 1, 2]
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"prompt": ["a"]}), bad / "0.parquet")
    pq.write_table(pa.table({"text": ["b"]}), bad / "1.parquet")
    with pytest.raises(PromptsFileError, match=re.escape(f"{bad / '1.parquet'} row 0: no field")):
        read_prompts(bad, "prompt")


def test_mixed_types_are_written_as_json_text(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl", ['{"prompt": "a", "x": 1}', '{"prompt": "b", "x": "y"}']
    )
    columns = read_prompts(path).columns
    assert is_json_text(columns.field("x"))
    assert not is_json_text(columns.field("id"))


@pytest.mark.parametrize(
    ("lines", "fields", "message"),
    [
        (
            ['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'],
            PromptFields(label="answer"),
            "line 2: no field 'answer' (fields: ['prompt'])",
        ),
        (
            ['{"prompt": "a", "answer": null}'],
            PromptFields(label="answer"),
            "line 1: field 'answer' is null",
        ),
        (
            ['{"prompt": "a", "id": 1}', '{"prompt": "b", "id": 1}'],
            PromptFields(id="id"),
            "line 2: id 1 (field 'id') repeats",
        ),
        (
            ['{"prompt": "a", "response": "x"}'],
            PromptFields(),
            "line 1: columns ['response'] clash with the output's own columns",
        ),
    ],
)
def test_bad_label_id_or_metadata_names_the_line(tmp_path, lines, fields, message):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(PromptsFileError, match=re.escape(f"{path} {message}")):
        read_prompts(path, fields)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "line 2: field 'prompt': no messages"),
        (["hi"], "line 2: field 'prompt': message 0 must be an object with 'role' and 'content'"),
        ([{"role": "user"}], "line 2: field 'prompt': message 0 needs a string 'content'"),
        (
            [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}],
            "line 2: field 'prompt': message 1 needs a string 'role'",
        ),
    ],
)
def test_malformed_messages_name_the_line(tmp_path, messages, message):
    lines = ['{"prompt": "ok"}', json.dumps({"prompt": messages})]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(PromptsFileError, match=re.escape(f"{path} {message}")):
        read_prompts(path, "prompt", chat)


def test_messages_need_the_chat_template(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl", [json.dumps({"prompt": [{"role": "user", "content": "a"}]})]
    )
    with pytest.raises(
        PromptsFileError,
        match="line 1: field 'prompt' holds chat messages: pass --apply-chat-template",
    ):
        read_prompts(path, "prompt")
