"""Read a labelled prompts file: JSONL, Parquet, or a directory of Parquet
files. Each row holds a text prompt or chat `messages`, optionally a label
and an id; every other column is the row's metadata, which travels to the
reward and into the output. Every problem fails with its exact place (file
and line for JSONL, file and row for Parquet), before anything is created.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.run.params import DataParams
from tasks.run.records import output_columns


class PromptsFileError(ValueError):
    """The prompts file is missing, empty or malformed."""


@dataclass(frozen=True)
class PromptRecord:
    """One input row: `prompt` is the text the engines get (rendered with the
    chat template when asked); `id` is the id column's value, else the row's
    position in the input."""

    id: Any
    prompt: str
    label: Any
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Prompts:
    """The prompts of a run, in file order; the input's digest (a rerun may
    only reuse shards written from the same input); and the Parquet types of
    the columns the input brings to the output (id, label, metadata)."""

    path: str
    records: list[PromptRecord]
    sha256: str
    columns: Any  # pyarrow.Schema

    def __len__(self) -> int:
        return len(self.records)

    @property
    def texts(self) -> list[str]:
        return [record.prompt for record in self.records]


@dataclass(frozen=True)
class PromptFields:
    """Which columns are what. `label` may be dotted (`reward_model.ground_truth`,
    verl's layout) to reach into a nested object."""

    prompt: str = "prompt"
    label: str | None = None
    id: str | None = None


ChatTemplate = Callable[[list[dict[str, str]]], str]


def read_prompts(
    path: str | Path,
    fields: PromptFields | str = PromptFields(),  # noqa: B008 - frozen
    chat_template: ChatTemplate | None = None,
) -> Prompts:
    """`chat_template`: renders a list of messages to the prompt text; None
    takes text prompts as they are and refuses rows holding messages."""
    if isinstance(fields, str):
        fields = PromptFields(prompt=fields)
    path = Path(path).expanduser().absolute()
    rows = list(read_rows(path))
    if not rows:
        raise PromptsFileError(f"prompts file {path} holds no prompts")
    records = [
        parse_row(row, where, position, fields, chat_template)
        for position, (where, row) in enumerate(rows)
    ]
    check_unique_ids(records, [where for where, _ in rows], fields)
    return Prompts(str(path), records, input_sha256(path), column_types(records))


def read_rows(path: Path):
    """(where, row dict) of every row, in order."""
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise PromptsFileError(f"prompts directory {path} holds no .parquet files")
        for file in files:
            yield from read_parquet(file)
    elif not path.is_file():
        raise PromptsFileError(f"prompts file {path} does not exist")
    elif path.suffix == ".parquet":
        yield from read_parquet(path)
    else:
        yield from read_jsonl(path)


def read_jsonl(path: Path):
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():  # blank lines (a trailing newline, say) carry nothing
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptsFileError(f"{where}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise PromptsFileError(
                    f"{where}: expected a JSON object, got {type(record).__name__}"
                )
            yield where, record


def read_parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise PromptsFileError(f"{path}: not a readable Parquet file ({exc})") from exc
    for row, record in enumerate(table.to_pylist()):
        yield f"{path} row {row}", record


def parse_row(
    row: dict[str, Any],
    where: str,
    position: int,
    fields: PromptFields,
    chat_template: ChatTemplate | None,
) -> PromptRecord:
    prompt = render_prompt(required(row, fields.prompt, where), where, fields.prompt, chat_template)
    label = required(row, fields.label, where) if fields.label else None
    row_id = required(row, fields.id, where) if fields.id else position
    # A dotted label leaves its nested object in the metadata (verl's
    # `reward_model` carries `style` beside `ground_truth`).
    taken = {fields.prompt, fields.id, fields.label}
    metadata = {k: v for k, v in row.items() if k not in taken}
    clash = sorted(set(metadata) & output_columns())
    if clash:
        raise PromptsFileError(
            f"{where}: columns {clash} clash with the output's own columns: rename them, "
            "or name them as the id or label field"
        )
    return PromptRecord(id=row_id, prompt=prompt, label=label, metadata=metadata)


def required(row: dict[str, Any], field: str, where: str) -> Any:
    """The value at `field` (dotted: nested), which must be present and not null."""
    value: Any = row
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            raise PromptsFileError(f"{where}: no field {field!r} (fields: {sorted(row)})")
        value = value[part]
    if value is None:
        raise PromptsFileError(f"{where}: field {field!r} is null")
    return value


def render_prompt(value: Any, where: str, field: str, chat_template: ChatTemplate | None) -> str:
    where = f"{where}: field {field!r}"
    if isinstance(value, str):
        if not value.strip():
            raise PromptsFileError(f"{where} is empty")
        # As OpenRLHF: with the chat template on, a text prompt is one user turn.
        return chat_template([{"role": "user", "content": value}]) if chat_template else value
    if not isinstance(value, list):
        raise PromptsFileError(
            f"{where} must be a string or a list of chat messages, got {type(value).__name__}"
        )
    messages = check_messages(value, where)
    if chat_template is None:
        raise PromptsFileError(f"{where} holds chat messages: pass --apply-chat-template")
    return chat_template(messages)


def check_messages(value: list, where: str) -> list[dict[str, str]]:
    if not value:
        raise PromptsFileError(f"{where}: no messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise PromptsFileError(
                f"{where}: message {i} must be an object with 'role' and 'content', got {message!r}"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise PromptsFileError(
                    f"{where}: message {i} needs a string {key!r}, got {message!r}"
                )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_unique_ids(records: list[PromptRecord], places: list[str], fields: PromptFields):
    if fields.id is None:
        return
    seen: dict[str, str] = {}
    for record, where in zip(records, places, strict=True):
        key = json.dumps(record.id, sort_keys=True, default=str)
        if key in seen:
            raise PromptsFileError(
                f"{where}: id {record.id!r} (field {fields.id!r}) repeats {seen[key]}"
            )
        seen[key] = where


def column_types(records: list[PromptRecord]):
    """Parquet types of id, label and the metadata columns, from all rows (so
    every shard has the same schema). A column whose values share no type is
    written as JSON text."""
    import pyarrow as pa

    names = ["id", "label"] + sorted({k for r in records for k in r.metadata})
    columns = []
    for name in names:
        values = [
            r.id if name == "id" else r.label if name == "label" else r.metadata.get(name)
            for r in records
        ]
        try:
            columns.append(pa.field(name, pa.array(values).type))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns.append(pa.field(name, pa.string(), metadata=JSON_TEXT))
    return pa.schema(columns)


#: Field metadata of a column written as JSON text (its values share no type).
JSON_TEXT = {"rolloutflow": "json"}


def is_json_text(field) -> bool:
    return (field.metadata or {}).get(b"rolloutflow") == b"json"


def input_sha256(path: Path) -> str:
    if not path.is_dir():
        return file_sha256(path)
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.parquet")):
        digest.update(f"{file.name}:{file_sha256(file)}\n".encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def chat_template_of(model: str) -> ChatTemplate:
    """The model's chat template as a function of messages (with the generation
    prompt appended, as for sampling). A model without one is an error."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if not getattr(tokenizer, "chat_template", None):
        raise PromptsFileError(
            f"--apply-chat-template: the tokenizer of {model} has no chat template"
        )

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render


def read_run_prompts(data: DataParams, model: str | None) -> Prompts:
    """A run's prompts, rendered with the model's chat template if asked."""
    template = chat_template_of(model) if data.apply_chat_template else None
    fields = PromptFields(prompt=data.prompt_field, label=data.label_field, id=data.id_field)
    return read_prompts(data.prompts_path, fields, template)
