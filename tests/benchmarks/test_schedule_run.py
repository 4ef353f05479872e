"""One run of the schedules benchmark (benchmarks/schedule_run.py), read
back from a call's JSON: `partial`'s stops, the one figure an older file
may lack, and the table's column of them."""

from __future__ import annotations

import pytest
from schedule_runs import run

from benchmarks.schedule_run import ScheduleRun
from benchmarks.schedules_report import table


def test_a_run_without_stops_reads_back_as_none_and_prints_a_dash():
    partial = ScheduleRun.from_json(run("partial", 42, 150, 0.9, stop_s=0.25), "a.json")
    sync = ScheduleRun.from_json(run("sync", 42, 100, 0.9), "a.json")
    older = run("partial", 43, 150, 0.9, stop_s=0.5)
    del older["stop_s"]  # written before the flow timed its stops
    older = ScheduleRun.from_json(older, "b.json")
    assert (partial.stop_s, sync.stop_s, older.stop_s) == (0.25, None, None)
    lines = table([sync, partial, older]).splitlines()
    assert "stop s" in lines[0]
    assert [line.split()[11] for line in lines[1:]] == ["-", "0.250", "-"]


def test_any_other_field_missing_is_still_refused_by_name():
    older = run("partial", 43, 150, 0.9)
    del older["other_s"]
    with pytest.raises(SystemExit, match="b.json holds a run without other_s"):
        ScheduleRun.from_json(older, "b.json")
