"""The run's output: shards of consecutive prompts, each written atomically
(write a temporary file, fsync, rename), so a shard file either holds every
row of its prompts or does not exist. A rerun skips the shards that exist.

Layout of one run (a flow run id keeps it across "Retry" of the run):

    <output_dir>/<run id>/run.json             what the shards were made from
    <output_dir>/<run id>/iter-000/shard-00000.parquet   (or .jsonl)

One format per run, so `pandas.read_parquet(<run>/iter-000)` and
`datasets.load_dataset("parquet", data_files="<run>/iter-*/*.parquet")` read
the shards as they are.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("parquet", "jsonl")
MANIFEST = "run.json"


class OutputMismatchError(ValueError):
    """The run directory holds shards made from other inputs."""


@dataclass(frozen=True)
class Shard:
    """Prompts `start` (inclusive) to `stop` (exclusive) of its round: the
    iteration's prompts (round 0), or a refill round's (dynamic sampling)."""

    index: int
    start: int
    stop: int
    round: int = 0

    def __len__(self) -> int:
        return self.stop - self.start


def plan_shards(num_prompts: int, shard_size: int, round: int = 0) -> list[Shard]:
    if num_prompts < 1 or shard_size < 1:
        raise ValueError(
            f"need num_prompts >= 1 and shard_size >= 1, got {num_prompts}, {shard_size}"
        )
    return [
        Shard(index, start, min(start + shard_size, num_prompts), round)
        for index, start in enumerate(range(0, num_prompts, shard_size))
    ]


def prepare_run_dir(run_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Create the run directory, or check that an existing one (an earlier
    attempt of the same run) was made from the same inputs: only then may its
    shards be reused."""
    run_dir = Path(run_dir).absolute()
    path = run_dir / MANIFEST
    if path.exists():
        earlier = json.loads(path.read_text())
        differ = sorted(
            k for k in set(earlier) | set(manifest) if earlier.get(k) != manifest.get(k)
        )
        if differ:
            was = {k: earlier.get(k) for k in differ}
            now = {k: manifest.get(k) for k in differ}
            raise OutputMismatchError(
                f"{run_dir} holds shards made from other inputs (was {was}, now {now}); "
                "use another output_dir"
            )
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(path, [json.dumps(manifest, indent=2, sort_keys=True)])
    return run_dir


class ShardStore:
    """The shards of one iteration. `input_columns`: the Parquet types of the
    columns the input brings (`Prompts.columns`)."""

    def __init__(
        self, directory: str | Path, output_format: str = "parquet", input_columns: Any = None
    ):
        if output_format not in FORMATS:
            raise ValueError(f"output_format must be one of {FORMATS}, got {output_format!r}")
        self.directory = Path(directory)
        self.suffix = output_format
        self.input_columns = input_columns
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, shard: Shard) -> Path:
        # Refill rounds sort after the iteration's own shards ("r" > digits).
        round_ = f"r{shard.round:02d}-" if shard.round else ""
        return self.directory / f"shard-{round_}{shard.index:05d}.{self.suffix}"

    def is_done(self, shard: Shard) -> bool:
        return self.path(shard).exists()

    def write(self, shard: Shard, rows: list[dict[str, Any]]) -> None:
        path = self.path(shard)
        if self.suffix == "parquet":
            write_parquet_atomically(path, rows, self.input_columns)
        else:
            lines = (json.dumps(row, ensure_ascii=False, default=str) for row in rows)
            write_atomically(path, lines)

    def count_rows(self, shard: Shard) -> int:
        """The rows of a written shard (an agent session may give several, or none)."""
        path = self.path(shard)
        if self.suffix == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        return sum(1 for line in path.read_text(encoding="utf-8").split("\n") if line)

    def read(self, shard: Shard, columns: list[str]) -> list[dict[str, Any]]:
        """`columns` of a written shard's rows."""
        path = self.path(shard)
        if self.suffix == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, columns=columns).to_pylist()
        lines = path.read_text(encoding="utf-8").split("\n")  # as `read_rows`
        return [{c: row.get(c) for c in columns} for row in map(json.loads, filter(None, lines))]

    def remove_partial_files(self) -> None:
        # Temporary files of an attempt that was killed mid-write: never read,
        # only in the way.
        for partial in self.directory.glob(".*.tmp"):
            partial.unlink(missing_ok=True)


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def write_atomically(path: Path, lines: Iterable[str]) -> None:
    tmp = temporary_path(path)
    try:
        with tmp.open("w", encoding="utf-8") as out:
            for line in lines:
                out.write(line)
                out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_parquet_atomically(
    path: Path, rows: list[dict[str, Any]], input_columns: Any = None
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.run.prompts import is_json_text
    from tasks.run.records import arrow_schema

    schema = arrow_schema(input_columns)
    as_json = [field.name for field in schema if is_json_text(field)]
    if as_json:
        rows = [
            {**row, **{k: json.dumps(row.get(k), default=str) for k in as_json}} for row in rows
        ]
    tmp = temporary_path(path)
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
        with tmp.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    # The rename itself is only durable once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_rows(directory: str | Path) -> list[dict[str, Any]]:
    """All rows of the shards in `directory` (JSONL preferred), shard by shard."""
    directory = Path(directory)
    rows: list[dict[str, Any]] = []
    jsonl = sorted(directory.glob("shard-*.jsonl"))
    if jsonl:
        for path in jsonl:
            # Rows end in "\n" alone: responses keep U+2028, U+0085 and the like
            # unescaped (ensure_ascii=False), where str.splitlines would break.
            text = path.read_text(encoding="utf-8")
            rows += [json.loads(line) for line in text.split("\n") if line]
        return rows
    import pyarrow.parquet as pq

    for path in sorted(directory.glob("shard-*.parquet")):
        rows += pq.read_table(path).to_pylist()
    return rows


def set_aside_iterations(run_dir: Path, attempt: int) -> Path | None:
    """An on-policy run cannot reuse an earlier attempt's rollouts: they came
    from a policy whose trained state died with that attempt (it is not
    checkpointed). Move them to `superseded-a<attempt>/`, kept for inspection,
    so this attempt starts its iterations over. Returns where they went."""
    earlier = sorted(run_dir.glob("iter-*"))
    if not earlier:
        return None
    aside = run_dir / f"superseded-a{attempt}"
    aside.mkdir(exist_ok=True)
    for directory in earlier:
        directory.rename(aside / directory.name)
    return aside
