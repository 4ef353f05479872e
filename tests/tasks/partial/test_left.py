"""What a partial iteration leaves generating beside the policy step, on
real CPU engine actors: the engines' busy time the flow counts idle from,
the next iteration's groups started in the places of the held samples done,
and the carry the stop writes."""

from __future__ import annotations

import time

import pytest
from partial_engines import LONG, SAMPLING, SHORT, TEXTS, groups, runner, still_generating
from waiting import wait_until

from engines import RequestError
from tasks.partial.left import LeftRunning
from tasks.partial.runner import SegmentRunner
from tasks.partial.segments import CarryStore, GroupState, SampleState


def new_group(slot: int, prompt_index: int | None = None) -> GroupState:
    """One of the next iteration's groups (origin 1), not started."""
    index = slot % 2 if prompt_index is None else prompt_index
    return GroupState(1, slot, index, 200 + slot, [SampleState(k, SHORT) for k in range(2)])


def test_left_running_reports_the_engines_busy_until_its_last_answer(pool, tmp_path):
    """The flow counts the engines idle from what `LeftRunning.stop` returns:
    now while a segment still generates, else the time of the last answer
    (not the generation task's end, not the stop). The stop's seconds are
    its parts' sum, the abort counted only when something still ran."""
    long_group, short_group = groups()
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    left = LeftRunning()
    left.hold(kept, CarryStore(tmp_path), 0, [long_group])
    wait_until(lambda: long_group.complete, 120, "the long group to finish")
    before = time.monotonic()
    stopped = left.stop()
    assert stopped.busy_until is not None and stopped.busy_until <= before
    assert stopped.iteration == 0 and stopped.abort_s == 0.0
    # Still generating at the stop: busy until the stop.
    long_group, short_group = groups()
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    left.hold(kept, CarryStore(tmp_path), 3, [long_group])
    before = time.monotonic()
    stopped = left.stop()
    assert stopped.busy_until >= before and not long_group.complete
    parts = stopped.join_s + stopped.abort_s + stopped.answers_s + stopped.carry_s
    assert stopped.iteration == 3 and stopped.abort_s > 0
    assert parts == pytest.approx(stopped.seconds)
    assert LeftRunning().stop() is None


def test_what_runs_beside_the_step_outlives_the_deadline_it_was_sent_with(pool, tmp_path):
    """A policy step may outlast the request deadline the rest was sent
    with: beside the step no such deadline counts, so no engine is taken
    for hung, and the rest completes or is stopped with its tokens."""
    long_group, short_group = groups()
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    for flight in kept.flights.values():
        flight.deadline = 0.0  # as if sent longer than timeout_s ago
    left = LeftRunning()
    left.hold(kept, CarryStore(tmp_path), 0, [long_group])
    wait_until(lambda: long_group.complete, 120, "the long group to finish")
    left.stop()
    assert not pool.failed and kept.counts.sent == 2
    (carried,) = CarryStore(tmp_path).load(0)
    assert carried.complete and all(len(s.token_ids) == LONG for s in carried.samples)


def test_the_next_groups_start_in_the_places_of_those_that_complete(pool, tmp_path):
    """The held group's samples, as they are done, give their places to the
    next iteration's groups, one after another, on the version served; the stop
    carries the held groups, then the next ones that started (not the rest)."""
    # LONG, not a few dozen tokens: the short group must complete the batch
    # first, and on a loaded box (CI's, two workers on two cores) its engine
    # once lagged the held group's by more than 48 tokens' time against 8.
    held, short_group = groups()
    kept = runner(pool)
    assert kept.run([held, short_group], keep_running=True) == [short_group]
    following = [new_group(slot) for slot in range(3)]
    left = LeftRunning()
    left.hold(kept, CarryStore(tmp_path), 0, [held], following)
    wait_until(lambda: all(g.complete for g in following), 120, "the next groups to complete")
    assert held.complete and not still_generating(kept)
    until = left.stop().busy_until
    assert until is not None and until <= time.monotonic()
    carried = CarryStore(tmp_path).load(0)
    assert [(g.origin, g.slot) for g in carried] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    for group in carried[1:]:
        # One request of n, as a new group is sent, under version 0.
        assert group.complete and group.waited(1) == 1
        assert all(s.segments == 1 and s.token_versions == [0] * SHORT for s in group.samples)


def test_held_groups_complete_before_the_step_give_their_places_at_once(pool, tmp_path):
    """The groups carried may all be complete when the step begins (the
    engines ran ahead of the policy): their samples' places go to the next
    groups at once, or the engines would idle through the step (one H200,
    the long tail: 5.4-5.7 s of a step with nothing running)."""
    held, short_group = groups(long=16)
    kept = SegmentRunner(pool, TEXTS, SAMPLING, batch=2, timeout_s=300, abort_timeout_s=60)
    kept.run([held, short_group], keep_running=True)
    assert held.complete and not kept.flights
    following = [new_group(slot) for slot in range(2)]
    left = LeftRunning()
    left.hold(kept, CarryStore(tmp_path), 0, [held], following)
    wait_until(lambda: all(g.complete for g in following), 120, "the next groups to complete")
    left.stop()
    carried = CarryStore(tmp_path).load(0)
    assert [(g.origin, g.slot) for g in carried] == [(0, 0), (1, 0), (1, 1)]
    # The generation's two requests, then one of n for each next group.
    assert kept.counts.sent == 2 + 2


def test_no_next_group_starts_while_the_held_ones_keep_their_places(pool, tmp_path):
    """A held group still generating keeps its place: nothing of the next
    iteration starts, and the carry holds the held group alone, aborted
    with its tokens."""
    long_group, short_group = groups()
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    left = LeftRunning()
    left.hold(kept, CarryStore(tmp_path), 0, [long_group], [new_group(0)])
    left.stop()
    carried = CarryStore(tmp_path).load(0)
    assert [(g.origin, g.slot) for g in carried] == [(0, 0)]
    assert all(s.finish_reason == "abort" and s.token_ids for s in carried[0].samples)


def test_the_next_iteration_takes_the_stops_carry_once(pool, tmp_path):
    """The carry the stop wrote goes to the next iteration from memory, as
    the file holds it (aborted samples with their tokens so far), once: a
    retry of that iteration, whose first try changed the groups, and any
    other iteration get None and read the file."""
    long_group, short_group = groups()
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    left = LeftRunning()
    assert left.carried(0) is None
    left.hold(kept, CarryStore(tmp_path), 0, [long_group])
    left.stop()
    assert left.carried(1) is None  # not the iteration the stop wrote
    left.hold(runner(pool), CarryStore(tmp_path), 0, [long_group])
    left.stop()
    carried = left.carried(0)
    assert carried == CarryStore(tmp_path).load(0) and carried[0] is long_group
    assert any(s.token_ids and not s.done for s in long_group.samples)
    assert left.carried(0) is None


def test_a_bad_next_group_ends_the_run_at_the_stop_with_the_carry_written(pool, tmp_path):
    """A request no engine can serve (an empty prompt) is no engine's
    failure: the stop still writes the carry, then raises it."""
    held, short_group = groups(long=16)
    # A batch of both: the run returns with the held group done, whichever
    # engine is faster (with a batch of one either group could be first).
    kept = SegmentRunner(pool, [*TEXTS, ""], SAMPLING, batch=2, timeout_s=300, abort_timeout_s=60)
    kept.run([held, short_group], keep_running=True)
    assert held.complete and not kept.flights
    left = LeftRunning()
    left.hold(kept, CarryStore(tmp_path), 0, [held], [new_group(0, prompt_index=2)])
    wait_until(lambda: kept.counts.sent == 3, 120, "the next group to be sent")
    with pytest.raises(RequestError, match="prompt 2"):
        left.stop()
    assert not pool.failed
    assert [(g.origin, g.slot) for g in CarryStore(tmp_path).load(0)] == [(0, 0), (1, 0)]
