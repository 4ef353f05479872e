"""The verdict over schedule runs made in several calls of
`benchmarks/schedules.py`, one seed a call (as on the GPU, where a call
has time for one seed's `sync` and partial runs): each run's steps/h
against its own call's `sync` (calls may land on machines of other
speeds, so a ratio is only taken side by side in one run), their mean and
spread over the calls, the engines' idle share, and the last batch's
reward against the range of `sync`'s over the seeds. Not a test: it
prints figures from the calls' `--json` files.

    python3 benchmarks/merge_schedules.py lt42.json lt43.json lt44.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.schedule_run import ScheduleRun  # noqa: E402
from benchmarks.schedules_report import spread, table  # noqa: E402


@dataclass(frozen=True)
class CallRun:
    """A run and the call it came from: its steps/h over that call's `sync`."""

    run: ScheduleRun
    x_sync: float
    call: str


def load(path: Path) -> list[CallRun]:
    """One call's runs, each against the call's own `sync`."""
    results = [ScheduleRun.from_json(r, path) for r in json.loads(path.read_text())["results"]]
    syncs = [r.steps_per_hour for r in results if r.schedule == "sync"]
    if not syncs:
        raise SystemExit(f"error: {path} holds no sync run to measure the others against")
    base = statistics.fmean(syncs)
    return [CallRun(r, r.steps_per_hour / base, path.name) for r in results]


def summary(results: list[CallRun]) -> list[str]:
    """Per schedule: the ratios to `sync` by call, their mean and spread, and
    the idle shares."""
    lines = []
    for schedule in dict.fromkeys(c.run.schedule for c in results):
        calls = [c for c in results if c.run.schedule == schedule]
        ratios = [c.x_sync for c in calls]
        idle = [100 * c.run.engine_idle_fraction for c in calls]
        by_seed = ", ".join(f"{c.run.seed}: {c.x_sync:.2f}x" for c in calls)
        lines.append(
            f"{schedule}: {len(calls)} runs; x own call's sync {by_seed} "
            f"(mean {statistics.fmean(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}); "
            f"idle {', '.join(f'{i:.1f}' for i in idle)}% (mean {statistics.fmean(idle):.1f}%)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+", help="the calls' --json files")
    args = parser.parse_args(argv)
    results = [c for path in args.json for c in load(path)]
    for path in args.json:
        print(f"{path.name}:\n{table([c.run for c in results if c.call == path.name])}\n")
    print("\n".join(summary(results)))
    if (line := spread([c.run for c in results])) is not None:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
