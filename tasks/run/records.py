"""One output row per sample: what a rollout record holds and how it is
built from an engine's `RequestOutput` or from an agent session's
`TrajectorySample`. Beside the engine's fields a row carries its input
row's id, label and metadata columns, and (on-policy runs) the reward and
the advantage the policy step used. Every row has the multi-turn columns:
a single-turn row is one assistant turn with its whole response sampled.
Also what a prompt row decides of its requests: their seeds and sampling."""

from __future__ import annotations

from typing import Any

from engines.outputs import RequestOutput
from engines.sampling import SamplingParams
from engines.trajectory import TrajectorySample


def arrow_schema(input_columns=None):
    """The output's columns, in order, with their Parquet types; then the
    columns the input brings (`Prompts.columns`: id, label, metadata)."""
    import pyarrow as pa

    top_entry = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
    turn = pa.struct(
        [
            ("role", pa.string()),
            ("start", pa.int64()),
            ("stop", pa.int64()),
            ("engine", pa.string()),
        ]
    )
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
            ("seed", pa.int64()),
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
            # engines/trajectory.py: 1 where the engine sampled the response
            # token (trained), 0 for environment and template tokens; the
            # version that sampled each token; the turns' [start, stop) spans.
            ("loss_mask", pa.list_(pa.int64())),
            ("token_versions", pa.list_(pa.int64())),
            ("turns", pa.list_(turn)),
            # A sample split from the one before it in its session, and why.
            ("split_reason", pa.string()),
            ("session_id", pa.string()),
            # Dynamic sampling: the refill round that made the row (0: the
            # iteration's own), and whether its group's rewards all agree
            # (kept on disk, left out of the policy step).
            ("refill_round", pa.int64()),
            ("filtered", pa.bool_()),
        ]
        + list(input_columns or [])
    )


def output_columns() -> set[str]:
    """Column names a row has before its input's metadata columns (an input
    column of the same name would clash)."""
    return set(arrow_schema().names) | {"id", "label"}


#: Seeds of refill round r start r strides up: past any iteration's seeds.
REFILL_SEED_STRIDE = 2**40


def request_seed(
    base_seed: int, iteration: int, prompt_index: int, num_prompts: int, refill_round: int = 0
) -> int:
    """The seed of one request, unique within a run: the rollout of a prompt
    does not depend on which engine served it, or on which attempt."""
    return base_seed + iteration * num_prompts + prompt_index + refill_round * REFILL_SEED_STRIDE


def record_sampling(sampling: SamplingParams, metadata: dict[str, Any]) -> SamplingParams:
    """A prompt row's own `max_tokens` (the long-tail workload's column)
    overrides the run's."""
    max_tokens = metadata.get("max_tokens")
    if max_tokens is None:
        return sampling
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"a prompt row's max_tokens must be an integer >= 1, got {max_tokens!r}")
    return sampling.model_copy(update={"max_tokens": max_tokens})


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
                "seed": seed,
                "reward": None,
                "advantage": None,
                "loss_mask": [1] * len(sample.token_ids),
                # The engine's per-token versions; where it reports none, the
                # admitted (oldest) version.
                "token_versions": sample.token_versions
                or [output.weight_version] * len(sample.token_ids),
                "turns": [
                    {
                        "role": "assistant",
                        "start": 0,
                        "stop": len(sample.token_ids),
                        "engine": output.engine,
                    }
                ],
                "split_reason": None,
                "session_id": None,
                "refill_round": 0,
                "filtered": None,
            }
        )
    return rows


def trajectory_row(
    sample: TrajectorySample,
    *,
    iteration: int,
    prompt_index: int,
    sample_index: int,
    prompt: str,
    response: str,
    session_id: str,
    seed: int,
) -> dict[str, Any]:
    """The row of one agent sample: its exact prompt and response stream
    (`response`: the stream's text, for reading); `weight_version` is the
    oldest that sampled one of its tokens."""
    sampled = [v for v, m in zip(sample.token_versions, sample.loss_mask, strict=True) if m]
    versions = sorted(set(sampled))
    engines = [t.engine for t in sample.turns if t.engine]
    return {
        "iteration": iteration,
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt": prompt,
        "prompt_token_ids": list(sample.prompt_token_ids),
        "response": response,
        "response_token_ids": list(sample.response_token_ids),
        # The session's requests each had one; the sample keeps none.
        "finish_reason": None,
        "cumulative_logprob": sum(sample.logprobs),
        "logprobs": list(sample.logprobs),
        "top_logprobs": None,
        "engine": engines[-1] if engines else None,
        "weight_version": versions[0] if versions else None,
        "weight_versions": versions,
        "seed": seed,
        "reward": None,
        "advantage": None,
        "loss_mask": list(sample.loss_mask),
        "token_versions": list(sample.token_versions),
        "turns": [turn.model_dump() for turn in sample.turns],
        "split_reason": sample.split_reason,
        "session_id": session_id,
        "refill_round": 0,
        "filtered": None,
    }


def with_input(row: dict[str, Any], record: Any) -> dict[str, Any]:
    """`row` with its input row's id, label and metadata columns
    (`record`: a `tasks.run.prompts.PromptRecord`)."""
    return {**row, "id": record.id, "label": record.label, **record.metadata}
