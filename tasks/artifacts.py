"""The run's Prefect artifacts: generation progress, a per-engine table and a
markdown summary."""

from __future__ import annotations

from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.pool import EnginePool

ENGINES_KEY = "rollout-engines"
SUMMARY_KEY = "rollout-summary"
TRAINING_KEY = "rollout-training"


def start_progress(iteration: int, done: int, total: int) -> UUID:
    return create_progress_artifact(
        progress=percent(done, total), description=f"Iteration {iteration}: shards written"
    )


def update_progress(artifact_id: UUID, done: int, total: int) -> None:
    update_progress_artifact(artifact_id, progress=percent(done, total))


def percent(done: int, total: int) -> float:
    return round(100.0 * done / total, 1) if total else 100.0


def publish_engine_table(pool: EnginePool) -> None:
    create_table_artifact(
        key=ENGINES_KEY,
        table=[stats.as_row() for stats in pool.stats],
        description="Per engine: prompts, tokens, tokens/s, failures, restarts, start-up time.",
    )


def publish_summary(markdown: str) -> None:
    create_markdown_artifact(markdown, key=SUMMARY_KEY, description="Rollout run summary")


def publish_training_table(rows: list[dict]) -> None:
    create_table_artifact(
        key=TRAINING_KEY,
        table=rows,
        description="Per iteration: mean reward, policy step, and the weight sync that "
        "followed (version, bytes, seconds, GB/s).",
    )
