"""Read prompts from a JSONL or Parquet file, failing with the exact place of
the first bad entry (line number for JSONL, row number for Parquet)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE


class PromptsFileError(ValueError):
    """The prompts file is missing, empty or malformed."""


@dataclass(frozen=True)
class Prompts:
    """The prompts of a run, in file order, and the file's digest (a rerun
    may only reuse shards written from the same file)."""

    path: str
    texts: list[str]
    sha256: str

    def __len__(self) -> int:
        return len(self.texts)


def read_prompts(path: str | Path, field: str) -> Prompts:
    path = Path(path).expanduser().absolute()
    if not path.is_file():
        raise PromptsFileError(f"prompts file {path} does not exist")
    if path.suffix == ".parquet":
        texts = read_parquet(path, field)
    else:
        texts = read_jsonl(path, field)
    if not texts:
        raise PromptsFileError(f"prompts file {path} holds no prompts")
    return Prompts(str(path), texts, file_sha256(path))


def read_jsonl(path: Path, field: str) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():  # blank lines (a trailing newline, say) carry nothing
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptsFileError(f"{path} line {number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise PromptsFileError(
                    f"{path} line {number}: expected a JSON object, got {type(record).__name__}"
                )
            if field not in record:
                raise PromptsFileError(
                    f"{path} line {number}: no field {field!r} (fields: {sorted(record)})"
                )
            texts.append(check_text(record[field], f"{path} line {number}: field {field!r}"))
    return texts


def read_parquet(path: Path, field: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise PromptsFileError(f"{path}: not a readable Parquet file ({exc})") from exc
    if field not in table.column_names:
        raise PromptsFileError(f"{path}: no column {field!r} (columns: {table.column_names})")
    return [
        check_text(value, f"{path} row {row}: column {field!r}")
        for row, value in enumerate(table.column(field).to_pylist())
    ]


def check_text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise PromptsFileError(f"{where} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise PromptsFileError(f"{where} is empty")
    return value


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@task(cache_policy=NO_CACHE, persist_result=False)
def load_prompts(path: str, field: str) -> Prompts:
    """Read and check every prompt before any engine is started."""
    prompts = read_prompts(path, field)
    get_run_logger().info("%d prompts from %s", len(prompts), prompts.path)
    return prompts
