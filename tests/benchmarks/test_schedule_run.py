"""One run of the schedules benchmark (benchmarks/schedule_run.py): the
part of its `other s` that `partial`'s stops took, read from its rows."""

from __future__ import annotations

from schedule_runs import run

from benchmarks.schedule_run import ScheduleRun
from benchmarks.schedules_report import table


def test_partials_stops_are_a_per_iteration_mean_over_all_its_rows():
    rows = [{"stop_seconds": 0.25}, {"stop_seconds": 0.5}, {"stop_seconds": 0.0}]
    partial = ScheduleRun.from_json(run("partial", 42, 150, 0.9, iterations=rows), "a.json")
    assert partial.stop_s == 0.25
    # `sync` stops nothing; a run written before the flow reported its
    # stops has rows without the field: neither claims a figure.
    sync = ScheduleRun.from_json(run("sync", 42, 100, 0.9, iterations=[{"stop_seconds": None}]), "")
    older = ScheduleRun.from_json(run("partial", 43, 150, 0.9, iterations=[{}]), "b.json")
    assert sync.stop_s is None and older.stop_s is None
    lines = table([sync, partial, older]).splitlines()
    assert "stop s" in lines[0]
    assert [line.split()[11] for line in lines[1:]] == ["-", "0.250", "-"]
