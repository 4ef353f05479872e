"""Reading prompts: every problem is reported with its place in the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.prompts import PromptsFileError, read_prompts

REPO_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "prompts.jsonl"


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_shipped_prompts_file_reads():
    prompts = read_prompts(REPO_PROMPTS, "prompt")
    assert len(prompts) == 32
    assert all(text.strip() for text in prompts.texts)
    assert len(prompts.sha256) == 64


def test_jsonl_keeps_file_order_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"text": "a", "id": 1}', "", '{"text": "b"}', "   "])
    assert read_prompts(path, "text").texts == ["a", "b"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "ok"}', '{"prompt": "ok"}', '{"prompt": "broken'], "line 3: not valid JSON"),
        (['{"prompt": "ok"}', "", '["a list"]'], "line 3: expected a JSON object, got list"),
        (['{"prompt": "ok"}', '{"text": "x"}'], "line 2: no field 'prompt' (fields: ['text'])"),
        (['{"prompt": 7}'], "line 1: field 'prompt' must be a string, got int"),
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
    with pytest.raises(PromptsFileError, match=r"no column 'prompt' \(columns: \['question'"):
        read_prompts(path, "prompt")


def test_parquet_null_names_the_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", None]}), path)
    with pytest.raises(PromptsFileError, match="row 1: column 'prompt' must be a string"):
        read_prompts(path, "prompt")


def test_digest_follows_content(tmp_path):
    one = write_lines(tmp_path / "one.jsonl", [json.dumps({"prompt": "a"})])
    two = write_lines(tmp_path / "two.jsonl", [json.dumps({"prompt": "b"})])
    assert read_prompts(one, "prompt").sha256 != read_prompts(two, "prompt").sha256
