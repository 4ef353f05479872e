"""One iteration of partial rollouts on the engines: the samples of every
group in flight are sent as segments (`tasks.partial.segments`), each to the
live engine with the fewest samples in flight; once `batch` groups are
complete, and every group at its wait bound too, the engines abort what
still runs (`pause_generation(mode="abort")` answers each
request with its tokens so far) and the unfinished samples wait for the next
iteration. A segment lost with its engine (dead or past its deadline) is
sent again, from the sample's tokens before it, to a surviving engine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import ray

from engines import EngineFailure, EngineTimeoutError, RequestError
from engines.client import collect, get
from engines.sampling import SamplingParams
from tasks.partial.segments import GroupState, SampleState
from tasks.run.dispatch import cancel
from tasks.run.pool import FETCH_TIMEOUT_S, EnginePool


@dataclass(eq=False)
class Segment:
    """One request in flight: a new group's samples, or one sample resumed."""

    group: GroupState
    samples: list[SampleState]
    engine: int
    restarts: int
    deadline: float


@dataclass
class SegmentCounts:
    """What one iteration's engines did: segments sent, resumed (a sample's
    second or later) and aborted at the iteration's end; tokens generated."""

    sent: int = 0
    resumed: int = 0
    aborted: int = 0
    tokens: int = 0


class SegmentRunner:
    """Runs groups' samples until `batch` groups are complete; then aborts
    the rest. `texts[g.prompt_index]`: a group's prompt text (its first
    segment's prompt; later ones send token ids)."""

    def __init__(
        self,
        pool: EnginePool,
        texts: list[str],
        sampling: SamplingParams,
        *,
        batch: int,
        timeout_s: float,
        abort_timeout_s: float,
    ):
        self.pool, self.texts, self.sampling = pool, texts, sampling
        self.batch, self.timeout_s, self.abort_timeout_s = batch, timeout_s, abort_timeout_s
        self.flights: dict[Any, Segment] = {}
        self.groups: list[GroupState] = []
        self.due: list[GroupState] = []
        self.completed: list[GroupState] = []
        self.counts = SegmentCounts()
        self.stopping = False
        # False beside the policy step (`beside_the_step`).
        self.deadlines = True

    def run(
        self, groups: list[GroupState], due: list[GroupState] = (), *, keep_running: bool = False
    ) -> list[GroupState]:
        """Complete groups in the order they completed (already complete ones
        first), once `batch` groups are complete and every group of `due`
        (those at their wait bound) too. Then the engines stop, or with
        `keep_running` go on with the rest until `finish`."""
        self.groups = list(groups)
        self.due = list(due)
        self.completed = [g for g in groups if g.complete]
        # Kept running, the groups not complete go on generating while the
        # policy trains even when complete ones (carried) already fill the
        # batch: else the engines idle through the whole step.
        self.stopping = self.enough() and not keep_running
        try:
            if not self.stopping:
                for group in groups:
                    self.send(group, [s for s in group.samples if not s.done])
            while self.flights and not self.enough():
                self.collect_one()
        except BaseException:
            # An error, the flow cancelled: stop the engines' work rather
            # than let it run on.
            self.abandon()
            raise
        if not keep_running:
            self.finish()
        return self.completed

    def abandon(self) -> None:
        """Cancel what runs, its tokens lost (an error, the flow stopped)."""
        cancel(list(self.flights))
        self.flights.clear()

    def finish(self) -> float:
        """Abort what still runs and take its tokens so far (the samples stay
        unfinished, to be resumed). Returns the seconds the engines took to
        answer the abort (0 when nothing ran)."""
        abort_s = 0.0
        try:
            if self.flights:
                began = time.monotonic()
                self.stop()
                abort_s = time.monotonic() - began
            while self.flights:
                self.collect_one()
        finally:
            self.abandon()
        return abort_s

    def send(self, group: GroupState, samples: list[SampleState]) -> None:
        """A group not started yet goes as one request of n samples (as
        `sync` sends it); a sample with tokens resumes alone from them."""
        if samples and all(s.segments == 0 for s in group.samples):
            self.send_one(group, group.samples, group.first_request(self.sampling))
            return
        for sample in samples:
            self.send_one(group, [sample], sample.request(self.sampling, group.seed))

    def send_one(self, group: GroupState, samples: list[SampleState], params: Any) -> None:
        live = self.pool.live()
        if not live:
            raise EngineFailure("no live engine left to resume the partial rollouts on")
        load = {e: 0 for e in live}
        for flight in self.flights.values():
            if flight.engine in load:
                load[flight.engine] += len(flight.samples)
        engine = min(live, key=lambda e: load[e])
        handle = self.pool.engines[engine]
        if samples[0].segments == 0:
            ref = handle.generate_text.remote(self.texts[group.prompt_index], params)
            self.pool.stats[engine].prompts += 1
        else:
            ref = handle.generate.remote(samples[0].prompt(), params)
            self.counts.resumed += 1
        self.counts.sent += 1
        self.pool.stats[engine].generate_calls += 1
        restarts = self.pool.stats[engine].restarts
        deadline = time.monotonic() + self.timeout_s if self.deadlines else math.inf
        self.flights[ref] = Segment(group, samples, engine, restarts, deadline)

    def collect_one(self, slice_s: float | None = None) -> float | None:
        """Take the next answer, waiting at most until the first deadline (or
        `slice_s`); when it came (`time.monotonic`, read before it is
        absorbed: a sample is complete only after its answer), None if none."""
        wait_s = max(0.0, min(f.deadline for f in self.flights.values()) - time.monotonic())
        if slice_s is not None:
            wait_s = min(wait_s, slice_s)
        ready, _ = ray.wait(list(self.flights), num_returns=1, timeout=wait_s)
        answered = time.monotonic() if ready else None
        for ref in ready:
            flight = self.flights[ref]
            try:
                output = get(ref, FETCH_TIMEOUT_S, self.pool.name(flight.engine))
            except EngineFailure as exc:
                self.lose_engine(flight.engine, flight.restarts, exc)
                continue
            except RequestError as exc:  # this request is bad: no retry can fix it
                raise type(exc)(f"prompt {flight.group.prompt_index}: {exc}") from exc
            del self.flights[ref]
            self.absorb(flight, output)
        now = time.monotonic()
        for flight in [f for f in self.flights.values() if f.deadline <= now]:
            name = self.pool.name(flight.engine)
            error = EngineTimeoutError(f"{name} did not answer within {self.timeout_s:g}s", name)
            self.lose_engine(flight.engine, flight.restarts, error)
        return answered

    def absorb(self, flight: Segment, output: Any) -> None:
        group, unfinished = flight.group, []
        completions = sorted(output.outputs, key=lambda c: c.index)
        for sample, completion in zip(flight.samples, completions, strict=True):
            sample.absorb(output, completion)
            self.counts.tokens += len(completion.token_ids)
            self.pool.stats[flight.engine].tokens += len(completion.token_ids)
            if sample.done:
                self.pool.stats[flight.engine].samples += 1
            else:
                self.counts.aborted += 1
                unfinished.append(sample)
        if unfinished and not self.stopping:  # stopped by something else (a pause by hand)
            self.send(group, unfinished)
        if group.complete:
            self.completed.append(group)

    def enough(self) -> bool:
        return len(self.completed) >= self.batch and all(g.complete for g in self.due)

    def stop(self) -> None:
        """The batch is complete: every engine ends what it runs now; the
        aborted segments come back with their tokens so far. An engine that
        died (or does not answer) is dropped from the stop, and its segments
        stay unfinished: carried with the tokens they had, to resume elsewhere."""
        self.stopping = True
        for method, kwargs in (("pause_generation", {"mode": "abort"}), ("resume_generation", {})):
            live = self.pool.live()
            restarts = [self.pool.stats[e].restarts for e in live]
            refs = [getattr(self.pool.engines[e], method).remote(**kwargs) for e in live]
            names = [self.pool.name(e) for e in live]
            results = collect(refs, names, method, self.abort_timeout_s)
            for engine, count, result in zip(live, restarts, results, strict=True):
                if isinstance(result.error, EngineFailure):
                    self.lose_engine(engine, count, result.error)
                elif result.error is not None:
                    raise result.error
        # The engines answered: their aborted segments are due now. A segment
        # kept running through a policy step may be past its send-time
        # deadline without any hang, and its tokens must not be dropped.
        due = time.monotonic() + self.abort_timeout_s
        for flight in self.flights.values():
            flight.deadline = due

    def beside_the_step(self) -> None:
        """What runs on beside the policy step (`tasks.partial.left`) runs
        until the flow stops it, however long the step: no deadline from a
        segment's send counts then, or a long step would count a healthy
        engine hung. The stop gives every segment `abort_timeout_s`."""
        self.deadlines = False
        for flight in self.flights.values():
            flight.deadline = math.inf

    def lose_engine(self, engine: int, restarts: int, error: EngineFailure) -> None:
        """Engine `engine` (at its `restarts`) is gone or hung: its segments
        are sent again from their samples' tokens before them, to the others."""
        self.pool.mark_failed(engine, error, restarts)
        refs = [r for r, f in self.flights.items() if f.engine == engine]
        lost = [self.flights.pop(ref) for ref in refs]
        cancel(refs)
        if self.stopping:
            return  # they stay unfinished: carried with the tokens they had
        for flight in lost:
            self.send(flight.group, flight.samples)
