"""One run of the schedules benchmark (`benchmarks/schedules.py`), as it
measured it: what its report prints, its `--json` holds, and
`benchmarks/merge_schedules.py` reads back from calls on other machines."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class ScheduleRun:
    schedule: str
    seed: int
    steps: int
    #: The iterations' wall time (start-up excluded: engines and policy load once).
    iterations_s: float
    steps_per_hour: float
    reward_first: float
    #: The last batch's mean reward (a partial batch mixes versions).
    reward_last: float
    #: The newest version that sampled some of the run's rows wholly, their
    #: mean reward, count and prompts (`row_checks.newest_version_reward`).
    newest_version: int | None
    reward_newest: float | None
    rows_newest: int
    prompts_newest: list[str]
    #: Per iteration (= version under `sync`), the mean reward per prompt:
    #: another run's newest rows are read against these on their prompts.
    reward_by_prompt: list[dict[str, float]]
    run_dir: str
    staleness_max: int
    #: A step skips samples whose group agreed, so a schedule whose rows lag
    #: learns from more of them per step.
    trained_samples: int
    #: Per iteration means of the phases, in seconds.
    generate_s: float
    train_s: float
    sync_s: float
    #: The rest of an iteration's wall time: the flow's hand-offs between
    #: its tasks, their bookkeeping, and under `partial` the stop of what was
    #: left running (the abort, the carry written again: `stop_s`).
    other_s: float
    engine_idle_s: float
    policy_idle_s: float
    #: The share of the run's wall time no generation ran.
    engine_idle_fraction: float
    #: `row_checks.RowChecks`' counts, and `ok`: whether they all passed.
    checks: dict[str, int | bool]
    #: The flow's training rows, one per iteration: where a mean hides one
    #: slow iteration (the one whose batch held the long samples).
    iterations: list[dict]
    #: Per iteration mean of `partial`'s stops before its syncs, part of
    #: `other_s`. None under the schedules that stop nothing, and in a JSON
    #: written before the flow timed them (the one field such a file may lack).
    stop_s: float | None = None

    @property
    def rows_ok(self) -> bool:
        return bool(self.checks["ok"])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, source: Path | str) -> ScheduleRun:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if missing := sorted(required - data.keys()):
            raise SystemExit(
                f"error: {source} holds a run without {', '.join(missing)}: written by an "
                "older benchmarks/schedules.py; run that call again"
            )
        return cls(**{name: data[name] for name in names & data.keys()})
