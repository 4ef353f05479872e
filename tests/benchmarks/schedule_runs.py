"""A schedules benchmark run as a call's JSON holds it, for the tests of
the modules that read one back."""

from __future__ import annotations

from benchmarks.schedule_run import ScheduleRun


def run(schedule: str, seed: int, steps_per_hour: float, reward_last: float, **extra) -> dict:
    """One run as a call's JSON holds it."""
    return ScheduleRun(
        **{
            "schedule": schedule,
            "seed": seed,
            "steps": 6,
            "iterations_s": 6 * 3600 / steps_per_hour,
            "steps_per_hour": steps_per_hour,
            "reward_first": 0.1,
            "reward_last": reward_last,
            "newest_version": 5,
            "reward_newest": reward_last,
            "rows_newest": 8,
            "prompts_newest": ["a", "b"],
            "reward_by_prompt": [],
            "run_dir": "/tmp/run",
            "staleness_max": 0,
            "trained_samples": 40,
            "generate_s": 1.0,
            "train_s": 1.0,
            "sync_s": 0.01,
            "other_s": 0.1,
            "engine_idle_s": 0.5,
            "policy_idle_s": 0.5,
            "engine_idle_fraction": 0.2,
            "checks": {"rows": 8, "bad_versions": 0, "duplicates": 0, "short_iterations": 0}
            | {"ok": True},
            "iterations": [],
            **extra,
        }
    ).to_json()
