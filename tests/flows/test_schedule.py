"""The pipeline's decisions (flows/schedule.py), driven by hand: which task
starts next under each schedule, and the idle time it records."""

from __future__ import annotations

from typing import get_args

import pytest

from flows.schedule import SCHEDULES, Pipeline, Schedule


def drain(pipeline: Pipeline, *, newest_first: bool = False) -> list[str]:
    """Run the pipeline to the end as the flow does, finishing the oldest
    running task first (`newest_first`: the newest); return what was started
    and finished, in order. Every start is checked against the bounds."""
    events: list[str] = []
    running: list[tuple[str, int]] = []
    clock = 0.0
    while not pipeline.done:
        if pipeline.should_sync():
            pipeline.sync_started(clock)
            running.append(("sync", pipeline.trained))
            events.append(f"sync v{pipeline.trained}")
        if (i := pipeline.next_training()) is not None:
            pipeline.training_started(i, clock)
            running.append(("train", i))
            events.append(f"train {i}")
        while (i := pipeline.next_generation()) is not None:
            assert not pipeline.trains or i - pipeline.served <= pipeline.max_staleness
            pipeline.generation_started(i, clock)
            running.append(("gen", i))
            events.append(f"gen {i}")
        assert len(pipeline.generating) <= pipeline.max_staleness + 1
        assert running, f"deadlock: {pipeline}"
        kind, value = running.pop(-1 if newest_first else 0)
        clock += 1.0
        if kind == "gen":
            pipeline.generation_done(value, clock)
        elif kind == "train":
            pipeline.training_done(value + 1, clock)
        else:
            pipeline.sync_done(value, clock)
        events.append(f"/{kind} {value}")
    return events


def most_at_once(events: list[str]) -> int:
    """The most generations running at once in `events`."""
    running = most = 0
    for event in events:
        running += event.startswith("gen ") - event.startswith("/gen ")
        most = max(most, running)
    return most


def test_sync_is_generate_train_sync_in_order():
    pipeline = Pipeline(3, "sync", 0)
    pipeline.start(0.0)
    events = [e for e in drain(pipeline) if not e.startswith("/")]
    assert events == [
        "gen 0", "train 0", "sync v1",
        "gen 1", "train 1", "sync v2",
        "gen 2", "train 2", "sync v3",
    ]  # fmt: skip


def test_partial_runs_in_sync_order_whatever_its_wait_bound():
    """Its bound is how long a partial rollout may wait (tasks/partial/task.py), so
    generation j still waits for version j, as under `sync`."""
    pipeline = Pipeline(3, "partial", 3)
    pipeline.start(0.0)
    events = [e for e in drain(pipeline) if not e.startswith("/")]
    assert events == [
        "gen 0", "train 0", "sync v1",
        "gen 1", "train 1", "sync v2",
        "gen 2", "train 2", "sync v3",
    ]  # fmt: skip


def test_overlap_generates_the_next_iteration_while_the_policy_trains():
    pipeline = Pipeline(3, "overlap", 1)
    pipeline.start(0.0)
    events = drain(pipeline)
    # Generation 1 starts with training 0, on version 0 (one behind).
    assert events.index("gen 1") == events.index("train 0") + 1
    # The sync waits for the engines to be idle, and generation 2 for the sync.
    assert events.index("sync v1") > events.index("/gen 1")
    assert events.index("gen 2") > events.index("sync v1")
    assert pipeline.served == pipeline.trained == 3
    assert most_at_once(events) == 1


def test_sync_and_overlap_run_one_generation_at_a_time():
    for schedule, staleness in [("sync", 0), ("overlap", 1), ("overlap", 2)]:
        pipeline = Pipeline(5, schedule, staleness)
        pipeline.start(0.0)
        assert most_at_once(drain(pipeline)) == 1, schedule


@pytest.mark.parametrize("staleness", [1, 2])
def test_in_flight_runs_up_to_staleness_plus_one_generations_at_once(staleness):
    pipeline = Pipeline(6, "in_flight", staleness)
    pipeline.start(0.0)
    events = drain(pipeline)  # it checks every start against the bound and S + 1
    # At the start every iteration within the bound of version 0 starts; the
    # next would pass it.
    assert events[: staleness + 2] == [*(f"gen {i}" for i in range(staleness + 1)), "/gen 0"]
    assert all(pipeline.engine_idle_s[i] == 0.0 for i in range(staleness + 1))
    assert most_at_once(events) == staleness + 1
    assert pipeline.served == pipeline.trained == 6 and pipeline.written == set(range(6))


def test_in_flight_starts_the_next_generation_once_the_bound_allows():
    pipeline = Pipeline(4, "in_flight", 1)
    pipeline.start(0.0)
    for i in (0, 1):
        pipeline.generation_started(i, 0.0)
    pipeline.generation_done(0, 2.0)
    assert pipeline.next_generation() is None  # 2 needs version 1 served
    pipeline.training_started(0, 2.0)
    pipeline.training_done(1, 3.0)
    pipeline.sync_started(3.0)  # under generation 1
    assert pipeline.next_generation() is None
    pipeline.sync_done(1, 3.5)
    assert pipeline.next_generation() == 2
    pipeline.generation_started(2, 3.5)
    assert pipeline.engine_idle_s[2] == 0.0  # generation 1 was running


def test_in_flight_generations_finish_out_of_order():
    """Generation 0's engine died: its retry ends after generation 1. Training
    waits for 0; 1's rows wait for it, and the run still finishes."""
    pipeline = Pipeline(3, "in_flight", 1)
    pipeline.start(0.0)
    for i in (0, 1):
        pipeline.generation_started(i, 0.0)
    pipeline.generation_done(1, 1.0)
    assert pipeline.written == {1} and pipeline.generating == {0}
    assert pipeline.next_training() is None  # training 0 needs iteration 0 written
    assert not pipeline.done
    pipeline.generation_done(0, 3.0)
    assert pipeline.next_training() == 0
    events = drain(pipeline, newest_first=True)
    assert events[0] == "train 0"
    assert pipeline.done and pipeline.trained == pipeline.served == 3
    # drain(newest_first) finishes later generations before earlier ones too.
    reordered = Pipeline(5, "in_flight", 2)
    reordered.start(0.0)
    events = drain(reordered, newest_first=True)
    finished = [int(e.split()[1]) for e in events if e.startswith("/gen ")]
    assert finished != sorted(finished) and reordered.done


def test_in_flight_syncs_under_a_running_generation():
    pipeline = Pipeline(3, "in_flight", 1)
    pipeline.start(0.0)
    pipeline.generation_started(0, 0.0)
    pipeline.generation_done(0, 1.0)
    assert pipeline.next_training() == 0
    pipeline.training_started(0, 1.0)
    assert pipeline.next_generation() == 1
    pipeline.generation_started(1, 1.0)
    pipeline.training_done(1, 2.0)
    assert pipeline.should_sync()  # generation 1 is running: in_flight syncs at once
    overlap = Pipeline(3, "overlap", 1, generating={1}, next_iteration=2, trained=1)
    assert not overlap.should_sync()


@pytest.mark.parametrize("schedule, staleness", [("overlap", 1), ("in_flight", 1), ("overlap", 2)])
def test_no_generation_starts_past_the_staleness_bound(schedule, staleness):
    pipeline = Pipeline(6, schedule, staleness)
    pipeline.start(0.0)
    started_on: dict[int, int] = {}
    original = pipeline.generation_started

    def record(iteration: int, now: float) -> None:
        started_on[iteration] = pipeline.served
        original(iteration, now)

    pipeline.generation_started = record
    drain(pipeline)
    assert sorted(started_on) == list(range(6))
    # Iteration j trains at version j on rows of version >= served at its start.
    assert all(j - served <= staleness for j, served in started_on.items()), started_on
    assert max(j - served for j, served in started_on.items()) == 1  # it does overlap


def test_a_sync_and_a_training_step_never_share_the_policy():
    pipeline = Pipeline(2, "overlap", 1, written={0, 1}, next_iteration=2, trained=1, served=0)
    pipeline.start(0.0)
    assert pipeline.should_sync() and pipeline.next_training() == 1
    pipeline.sync_started(0.0)
    assert pipeline.next_training() is None  # it waits for the sync
    pipeline.sync_done(1, 1.0)
    pipeline.training_started(1, 1.0)
    assert not pipeline.should_sync()


def test_a_failed_sync_waits_for_the_generation_that_replaces_the_engine():
    pipeline = Pipeline(3, "in_flight", 1, written={0}, next_iteration=1, trained=1)
    pipeline.start(0.0)
    pipeline.generation_started(1, 0.0)
    pipeline.sync_started(0.0)
    assert pipeline.sync_failed(1.0)  # the generation's retry replaces the engine
    assert not pipeline.should_sync()
    pipeline.generation_done(1, 2.0)
    assert pipeline.should_sync()
    idle = Pipeline(3, "sync", 0, written={0}, next_iteration=1, trained=1)
    idle.start(0.0)
    idle.sync_started(0.0)
    assert not idle.sync_failed(1.0)  # no generation will replace it: the caller raises


def test_a_failed_sync_waits_for_every_generation_running_at_the_failure():
    """Two generations ran when the sync failed: either one's retry may
    replace the engine, so the next sync waits until both have finished; a
    generation started after the failure does not hold it."""
    pipeline = Pipeline(4, "in_flight", 1)
    pipeline.start(0.0)
    for i in (0, 1):
        pipeline.generation_started(i, 0.0)
    pipeline.generation_done(0, 1.0)
    pipeline.training_started(0, 1.0)
    pipeline.training_done(1, 2.0)
    pipeline.sync_started(2.0)
    pipeline.sync_done(1, 2.5)
    pipeline.generation_started(2, 2.5)  # beside generation 1
    pipeline.generation_done(2, 3.0)  # 2 finishes first
    pipeline.generation_started(3, 3.0)
    assert pipeline.generating == {1, 3}
    pipeline.training_started(1, 3.0)
    pipeline.training_done(2, 4.0)
    pipeline.sync_started(4.0)
    assert pipeline.sync_failed(5.0)
    assert pipeline.sync_held_for == {1, 3}
    pipeline.generation_done(3, 6.0)
    assert not pipeline.should_sync()  # generation 1's retry may still replace it
    pipeline.generation_done(1, 7.0)
    assert pipeline.should_sync()


@pytest.mark.parametrize(
    ("schedule", "staleness", "kept_busy", "idle"),
    [
        ("sync", 0, False, 3.0),  # train + sync
        ("partial", 4, False, 3.0),
        # The groups a partial step did not take ran until the sync aborted them.
        ("partial", 4, True, 1.0),  # the sync only
    ],
)
def test_idle_seconds_of_engines_and_policy(schedule, staleness, kept_busy, idle):
    pipeline = Pipeline(2, schedule, staleness)
    pipeline.start(0.0)
    pipeline.generation_started(0, 0.0)
    pipeline.generation_done(0, 4.0)
    pipeline.training_started(0, 4.0)
    pipeline.training_done(1, 6.0)
    if kept_busy:
        pipeline.engines_busy(6.0)
    pipeline.sync_started(6.0)
    pipeline.sync_done(1, 7.0)
    pipeline.generation_started(1, 7.0)
    pipeline.generation_done(1, 11.0)
    pipeline.training_started(1, 11.0)
    assert pipeline.engine_idle_s == {0: 0.0, 1: idle}
    assert pipeline.policy_idle_s == {0: 4.0, 1: 4.0}  # generation 0; generation 1


def test_the_wait_for_a_policy_that_comes_up_after_generation_0_is_start_up():
    pipeline = Pipeline(2, "partial", 4)
    pipeline.start(0.0)
    pipeline.generation_started(0, 0.0)
    pipeline.generation_done(0, 2.0)
    pipeline.policy_up(5.0)  # a colocated policy loads once the engines are up
    pipeline.training_started(0, 5.0)
    pipeline.training_done(1, 6.0)
    pipeline.sync_started(6.0)
    pipeline.sync_done(1, 7.0)
    pipeline.generation_started(1, 7.0)
    assert pipeline.startup_wait_s == 3.0
    assert pipeline.engine_idle_s[1] == 2.0 and pipeline.policy_idle_s[0] == 0.0


def test_a_plain_run_only_generates():
    pipeline = Pipeline(2, "sync", 0, trains=False)
    pipeline.start(0.0)
    assert drain(pipeline) == ["gen 0", "/gen 0", "gen 1", "/gen 1"]


@pytest.mark.parametrize(
    "schedule, staleness, message",
    [
        ("sync", 1, "max_staleness 0, got 1"),
        ("overlap", 0, "needs max_staleness >= 1, got 0"),
        ("partial", 0, "needs max_staleness >= 1, got 0"),
        ("lockstep", 0, "'lockstep'"),
    ],
)
def test_bad_schedules_are_named(schedule, staleness, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(2, schedule, staleness)


def test_every_schedule_the_parameters_accept_has_its_rule():
    assert list(SCHEDULES) == list(get_args(Schedule))
    assert [rule.bound(3) for rule in SCHEDULES.values()] == [0, 3, 3, 3]
