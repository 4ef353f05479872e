"""What the CLI prints at a run's end (flows/cli.py `print_results`): one
line per iteration, with `partial`'s stop before the sync where it ran."""

from __future__ import annotations

from types import SimpleNamespace

from flows.cli import print_results
from tasks.run.report import TrainingRow


def row(iteration: int, stop_seconds: float | None) -> TrainingRow:
    # The real row type: a field renamed there fails here too.
    return TrainingRow(
        iteration=iteration,
        mean_reward=0.5,
        reward_std=0.1,
        samples=64,
        trained_samples=60,
        trained_tokens=6_000,
        generate_seconds=1.0,
        reward_seconds=0.01,
        train_seconds=2.0,
        engine_idle_seconds=0.1,
        policy_idle_seconds=0.2,
        staleness_max=1,
        logprob_mismatch=None,
        sync_seconds=0.02,
        weight_version=iteration + 1,
        sync_bytes=2_000_000,
        sync_gb_per_s=0.1,
        stop_seconds=stop_seconds,
    )


def test_a_partial_iteration_says_what_its_stop_took_before_the_sync(capsys):
    summary = SimpleNamespace(
        training=[row(0, None), row(1, 0.151)], rows=128, output_dir="/out", curves=None
    )
    print_results(summary)
    plain, partial = capsys.readouterr().out.splitlines()[:2]
    assert plain.endswith("staleness 1; synced v1 (2.0 MB in 0.020 s)")
    assert "stopped" not in plain
    assert partial.endswith(
        "staleness 1; left running stopped in 0.151 s; synced v2 (2.0 MB in 0.020 s)"
    )
