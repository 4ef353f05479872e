"""The verdict over calls of the schedules benchmark (benchmarks/merge_schedules.py):
each run is measured against its own call's `sync`, never against another
machine's."""

from __future__ import annotations

import json

import pytest
from schedule_runs import run

from benchmarks import merge_schedules


def call(tmp_path, name: str, *results: dict):
    path = tmp_path / name
    path.write_text(json.dumps({"args": {}, "results": list(results)}))
    return path


def test_each_run_is_held_against_its_own_calls_sync(tmp_path, capsys):
    # Two machines, one twice as fast: against the mean sync (150 steps/h)
    # the partial runs would read 1.07x and 2.00x.
    slow = call(
        tmp_path,
        "a.json",
        run("sync", 42, 100, 0.95, reward_by_prompt=[{}] * 4 + [{"a": 0.9, "b": 0.7}, {}]),
        run("partial_next", 42, 160, 0.90, newest_version=4, prompts_newest=["b", "b"]),
    )
    fast = call(tmp_path, "b.json", run("sync", 43, 200, 1.0), run("partial_next", 43, 300, 0.97))
    assert merge_schedules.main([str(slow), str(fast)]) == 0
    out = capsys.readouterr().out
    ratios = "x own call's sync 42: 1.60x, 43: 1.50x (mean 1.55x, 1.50-1.60)"
    assert f"partial_next: 2 runs; {ratios}" in out
    assert "sync's reward after the same steps over 2 seeds: 0.950-1.000" in out
    assert "partial_next: 0.900 (outside sync's spread)" in out
    assert "partial_next: 0.970 (within sync's spread)" in out
    # The newest rows' prompts and version, read against the sync run of its
    # seed from its JSON alone.
    assert "sync seed 42, version 4, same prompts: 0.700" in out


def test_a_call_without_sync_is_refused_by_name(tmp_path):
    lone = call(tmp_path, "lone.json", run("partial_next", 42, 160, 0.9))
    with pytest.raises(SystemExit, match="lone.json holds no sync run"):
        merge_schedules.main([str(lone)])


def test_a_call_written_before_a_field_existed_is_refused_by_name(tmp_path):
    old = run("sync", 42, 100, 0.95)
    del old["reward_by_prompt"], old["newest_version"]
    path = call(tmp_path, "old.json", old)
    with pytest.raises(SystemExit, match="old.json holds a run without newest_version, rew"):
        merge_schedules.main([str(path)])
