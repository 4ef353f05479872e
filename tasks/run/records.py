"""One output row per sample: what a rollout record holds and how it is
built from an engine's `RequestOutput`. Beside the engine's fields a row
carries its input row's id, label and metadata columns, and (on-policy runs)
the reward and the advantage the policy step used."""

from __future__ import annotations

from typing import Any

from engines.outputs import RequestOutput


def arrow_schema(input_columns=None):
    """The output's columns, in order, with their Parquet types; then the
    columns the input brings (`Prompts.columns`: id, label, metadata)."""
    import pyarrow as pa

    top_entry = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
    return pa.schema(
        [
            ("iteration", pa.int64()),
            ("prompt_index", pa.int64()),
            ("sample_index", pa.int64()),
            ("prompt", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int64())),
            ("response", pa.string()),
            ("response_token_ids", pa.list_(pa.int64())),
            ("finish_reason", pa.string()),
            ("cumulative_logprob", pa.float64()),
            # Per position: the sampled token's logprob, and the top k tokens
            # when asked for (JSON objects cannot have integer keys, hence a list).
            ("logprobs", pa.list_(pa.float64())),
            ("top_logprobs", pa.list_(pa.list_(top_entry))),
            ("engine", pa.string()),
            ("weight_version", pa.int64()),
            # Every version the request ran under (more than one: a sync
            # landed while it was in flight).
            ("weight_versions", pa.list_(pa.int64())),
            # Per response token: the version that sampled it (null: the
            # backend cannot tell).
            ("token_versions", pa.list_(pa.int64())),
            ("seed", pa.int64()),
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
        ]
        + list(input_columns or [])
    )


def output_columns() -> set[str]:
    """Column names a row has before its input's metadata columns (an input
    column of the same name would clash)."""
    return set(arrow_schema().names) | {"id", "label"}


def request_seed(base_seed: int, iteration: int, prompt_index: int, num_prompts: int) -> int:
    """The seed of one request, unique within a run: the rollout of a prompt
    does not depend on which engine served it, or on which attempt."""
    return base_seed + iteration * num_prompts + prompt_index


def rows_for(
    output: RequestOutput,
    *,
    iteration: int,
    prompt_index: int,
    prompt: str,
    seed: int,
    with_logprobs: bool,
) -> list[dict[str, Any]]:
    rows = []
    for sample in output.outputs:
        sampled, top = None, None
        if with_logprobs and sample.logprobs is not None:
            sampled = [
                position[token].logprob
                for position, token in zip(sample.logprobs, sample.token_ids, strict=True)
            ]
            top = [
                [
                    {"token_id": token_id, "logprob": entry.logprob}
                    for token_id, entry in sorted(position.items(), key=lambda kv: -kv[1].logprob)
                ]
                for position in sample.logprobs
            ]
        rows.append(
            {
                "iteration": iteration,
                "prompt_index": prompt_index,
                "sample_index": sample.index,
                "prompt": prompt,
                "prompt_token_ids": list(output.prompt_token_ids),
                "response": sample.text,
                "response_token_ids": list(sample.token_ids),
                "finish_reason": sample.finish_reason,
                "cumulative_logprob": sample.cumulative_logprob,
                "logprobs": sampled,
                "top_logprobs": top,
                "engine": output.engine,
                "weight_version": output.weight_version,
                "weight_versions": list(output.weight_versions),
                "token_versions": sample.token_versions,
                "seed": seed,
                "reward": None,
                "advantage": None,
            }
        )
    return rows


def with_input(row: dict[str, Any], record: Any) -> dict[str, Any]:
    """`row` with its input row's id, label and metadata columns
    (`record`: a `tasks.run.prompts.PromptRecord`)."""
    return {**row, "id": record.id, "label": record.label, **record.metadata}
