"""The run's progress: the numbers, the same in the bar and the Prefect
progress artifact (stand-ins record the artifact calls), the bar drawn
through Prefect's log console, and silence off a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.theme import Theme

from tasks.run import progress as progress_module
from tasks.run.progress import RunProgress


@pytest.fixture
def artifact_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(
        progress_module,
        "create_progress_artifact",
        lambda **kwargs: calls.append({"create": True, **kwargs}) or "artifact-id",
    )
    monkeypatch.setattr(
        progress_module,
        "update_progress_artifact",
        lambda artifact_id, **kwargs: calls.append({"id": artifact_id, **kwargs}),
    )
    return calls


def prefect_like_console(**kwargs) -> tuple[Console, io.StringIO]:
    # Prefect's console handler builds its theme without rich's defaults.
    out = io.StringIO()
    return Console(file=out, theme=Theme({}, inherit=False), width=160, **kwargs), out


def test_rows_tokens_eta_and_restarts_reach_the_artifact(artifact_calls):
    console, _ = prefect_like_console(force_terminal=True)
    with RunProgress(console) as run:
        bar = run.iteration(3, total_rows=100)
        bar.reused(20, restarts=0)
        bar.began -= 10.0  # as if the iteration began 10 s ago
        bar.written(10, tokens=400, restarts=1)
    assert artifact_calls[0]["progress"] == 0.0
    last = artifact_calls[-1]
    assert last["id"] == "artifact-id" and last["progress"] == 30.0
    # 10 new rows in 10 s: 70 rows to go take 70 s.
    assert last["description"] == (
        "Iteration 3: 30/100 rows, 40 tokens/s, ETA 0:01:10, 1 engine restarts"
    )
    bar.written(70, tokens=100, restarts=1)
    assert artifact_calls[-1]["progress"] == 100.0 and bar.eta() == "0:00:00"


def test_bars_draw_on_a_terminal_with_log_lines_above(artifact_calls):
    console, out = prefect_like_console(force_terminal=True)
    with RunProgress(console) as run:
        bar = run.iteration(0, total_rows=8)
        console.print("a log line")
        bar.written(8, tokens=64, restarts=0)
    text = out.getvalue()
    assert "a log line\n" in text
    last_drawn = text.split("\r")[-1]  # the bars' final state
    assert "8/8 rows" in last_drawn and "0 engine restarts" in last_drawn


def test_quiet_off_a_terminal(artifact_calls):
    console, out = prefect_like_console()
    with RunProgress(console) as run:
        run.iteration(0, total_rows=8).written(8, tokens=64, restarts=0)
    assert out.getvalue() == ""
    assert artifact_calls[-1]["progress"] == 100.0  # the artifact still follows


def test_only_running_iterations_have_a_bar(artifact_calls):
    console, out = prefect_like_console(force_terminal=True)
    with RunProgress(console) as run:
        run.iteration(0, total_rows=8).written(8, tokens=64, restarts=0)
        second = run.iteration(1, total_rows=8)
        third = run.iteration(2, total_rows=8)  # in_flight: beside iteration 1
        assert [task.visible for task in run.bars.tasks] == [False, True, True]
        second.written(4, tokens=32, restarts=0)
        third.written(2, tokens=16, restarts=0)
    last_drawn = out.getvalue().split("\r")[-1]
    assert "iteration 1" in last_drawn and "4/8 rows" in last_drawn
    assert "iteration 2" in last_drawn and "2/8 rows" in last_drawn
