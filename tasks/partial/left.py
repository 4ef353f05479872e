"""What a `partial` iteration leaves generating while the policy trains
(`PartialPlan.keep_generating`), so the engines do not wait for the step.

The groups the step did not take go on, on the version that started them;
with `PartialPlan.start_next`, the places of their samples that are done go
to the next iteration's new groups, so the engines keep as much work as the
held groups make until the step ends, and the next iteration finds groups
done. The flow stops it all before the sync (a vLLM segment runs under one
version, so the sync must find the engines idle): the unfinished samples'
tokens so far, and the next iteration's groups that were started, go into
the iteration's carry, which the next iteration takes from the stop
(`LeftRunning.carried`) rather than read back from disk.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from engines import EngineFailure
from tasks.partial.runner import SegmentRunner
from tasks.partial.segments import CarryStore, GroupState
from tasks.run.pool import FETCH_TIMEOUT_S

#: How long the thread waits for an answer before it looks for the stop:
#: the stop, on the sync's path, waits up to this long for it.
STOP_CHECK_S = 0.02


@dataclass(frozen=True)
class LeftStopped:
    """What a stop of `LeftRunning` found and cost, on the sync's path."""

    iteration: int
    #: Until when the engines were busy with it (`time.monotonic`): the
    #: stop when a segment still generated, else its last answer; None when
    #: nothing answered beside the step.
    busy_until: float | None
    #: The stop in all, then its parts: the thread's end, the engines'
    #: answers to the abort, the aborted segments' answers taken, the carry
    #: written.
    seconds: float
    join_s: float
    abort_s: float
    answers_s: float
    carry_s: float


class LeftRunning:
    """Runs beside the policy step, in a thread of the flow's process that
    takes the engines' answers as they come (not all at the stop) and starts
    the next iteration's groups. A plain class: Prefect passes it to the
    generation task as it is."""

    def __init__(self) -> None:
        self._runner: SegmentRunner | None = None
        self._carry: CarryStore | None = None
        self._iteration = 0
        self._groups: list[GroupState] = []
        self._next: list[GroupState] = []
        self._started: list[GroupState] = []
        self._places = 0
        self._last_answer: float | None = None
        self._error: BaseException | None = None
        #: (iteration, groups) of the last stop's carry, until the next iteration takes it.
        self._carried: tuple[int, list[GroupState]] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(
        self,
        runner: SegmentRunner,
        carry: CarryStore,
        iteration: int,
        groups: list[GroupState],
        next_groups: list[GroupState] = (),
    ) -> None:
        """Keep `runner`'s segments (of `groups`, the iteration's carry)
        generating; start `next_groups`, in order, in the places of the held
        groups' samples that are done."""
        self._runner, self._carry, self._iteration = runner, carry, iteration
        self._groups, self._next, self._started = groups, list(next_groups), []
        # A place per sample of the held groups, done or not: the engines
        # run no more beside the step than those groups would have (a
        # colocated policy shares the device with them), and a sample done
        # gives its place to the next groups. Counting only the samples
        # running at the hold left the engines idle through the whole step
        # whenever the held groups had completed before it.
        self._places = sum(len(group.samples) for group in groups)
        runner.beside_the_step()
        self._last_answer, self._error = None, None
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="partial-left-running", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        runner = self._runner
        try:
            while not self._stopping.is_set():
                running = running_samples(self._groups + self._started)
                while self._next and running < self._places:
                    group = self._next.pop(0)
                    runner.send(group, group.samples)
                    self._started.append(group)
                    running += len(group.samples)
                if not runner.flights:
                    return
                answered = runner.collect_one(STOP_CHECK_S)
                if answered is not None:
                    self._last_answer = answered
        except BaseException as exc:  # read at the stop, in the flow's thread
            self._error = exc

    def stop(self) -> LeftStopped | None:
        """Abort what runs and rewrite the carry (the held groups, then the
        next iteration's that were started); None when nothing was held."""
        runner, carry, self._runner = self._runner, self._carry, None
        if runner is None or carry is None:
            return None
        began = time.monotonic()
        self._join()
        joined = time.monotonic()
        busy_until = joined if runner.flights else self._last_answer
        held = self._groups + self._started
        try:
            abort_s = runner.finish()
        finally:  # the tokens taken so far are kept whatever the stop raised
            finished = time.monotonic()
            carry.write(self._iteration, held)
        # An engine lost beside the step is the sync's to replace (it
        # replaces failed engines first); anything else ends the run.
        if self._error is not None and not isinstance(self._error, EngineFailure):
            raise self._error
        ended = time.monotonic()
        self._carried = (self._iteration, held)
        return LeftStopped(
            iteration=self._iteration,
            busy_until=busy_until,
            seconds=ended - began,
            join_s=joined - began,
            abort_s=abort_s,
            answers_s=finished - joined - abort_s,
            carry_s=ended - finished,
        )

    def carried(self, iteration: int) -> list[GroupState] | None:
        """The groups the last stop wrote to `iteration`'s carry, given once:
        the next iteration's generation starts from them instead of reading
        the file back while the engines wait (its parse took longer than its
        writing: benchmarks/carry_cost.py). None when no stop wrote that
        carry in this process, or it was taken: a retry, whose first try
        changed the groups, and a resumed run start from the file."""
        carried, self._carried = self._carried, None
        if carried is None or carried[0] != iteration:
            return None
        return carried[1]

    def abandon(self) -> None:
        """The run ends before the stop (a failure): cancel what runs."""
        self._carried = None
        runner, self._runner = self._runner, None
        if runner is not None:
            try:
                self._join()
            finally:
                runner.abandon()

    def _join(self) -> None:
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        # Its longest step is fetching an answer `ray.wait` found ready.
        thread.join(FETCH_TIMEOUT_S + STOP_CHECK_S)
        if thread.is_alive():
            raise RuntimeError(
                f"partial iteration {self._iteration}: what ran beside the policy step "
                f"did not stop within {FETCH_TIMEOUT_S + STOP_CHECK_S:g}s"
            )


def running_samples(groups: list[GroupState]) -> int:
    return sum(not sample.done for group in groups for sample in group.samples)
