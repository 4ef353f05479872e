"""The run's Prefect artifacts: a per-engine table, a training table and a
markdown summary (generation progress: tasks/run/progress.py)."""

from __future__ import annotations

from dataclasses import asdict

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.run.pool import EnginePool
from tasks.run.report import TrainingRow

ENGINES_KEY = "rollout-engines"
SUMMARY_KEY = "rollout-summary"
TRAINING_KEY = "rollout-training"


def publish_engine_table(pool: EnginePool) -> None:
    create_table_artifact(
        key=ENGINES_KEY,
        table=[stats.as_row() for stats in pool.stats],
        description="Per engine: prompts, tokens, tokens/s, failures, restarts, start-up "
        "time, and the last replacement (a warm spare, a restart, a prepared actor or a new "
        "engine) with the seconds it "
        "took to serve again; each engine's OpenAI URL with openai_api.",
    )


def publish_summary(markdown: str) -> None:
    create_markdown_artifact(markdown, key=SUMMARY_KEY, description="Rollout run summary")


def publish_training_table(rows: list[TrainingRow]) -> None:
    create_table_artifact(
        key=TRAINING_KEY,
        table=[asdict(row) for row in rows],
        description="Per iteration: mean reward; the samples the step learned from and their "
        "tokens; generate, train and sync seconds; idle seconds of the engines and the "
        "policy; staleness of the rows (versions) and the policy/engine logprob mismatch; "
        "the weight sync that published the step; under partial, the stop of what ran on "
        "beside the step.",
    )
