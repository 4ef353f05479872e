"""When the rollout flow starts each task: pure decisions over what is done
and what is running, so the flow body only submits and collects.

Three kinds of work: a generation (the engines), a training step (the
policy) and a weight sync (both). With S the staleness bound (0 for `sync`):

- generation of iteration j starts when the engines serve version >= j - S;
  under `sync` and `overlap` also only when no generation runs, under
  `in_flight` beside the running ones (the engines batch their requests
  together). The bound alone limits `in_flight` to S + 1 generations at
  once: j needs the sync of version j - S, which needs generation j - S - 1
  written. Generations may finish out of order (a retry after an engine
  failure), so the pipeline tracks which iterations are written;
- training on iteration j starts when its rollouts are written and the
  policy has trained on j - 1;
- a sync of the policy's newest version starts after a training step:
  `sync` and `overlap` when no generation runs (the engines are idle),
  `in_flight` at once, under the running generations (their requests freeze
  and continue on the new weights; their rows record both versions).

`partial` runs as `sync` does (its bound is how long a partial rollout may
wait, tasks/partial/task.py, not a lag between generation and sync); the groups
a step does not take may go on generating under it, until the sync.

The policy actor runs one method at a time, so a sync and a training step
are never submitted together: the sync goes first, as the engines wait for it.

What each schedule decides is one row of `SCHEDULES`: the parameters check
the staleness bound by it (flows/params.py), the flow picks the generation
task by it (flows/iterations.py), and the pipeline starts work by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Schedule = Literal["sync", "overlap", "in_flight", "partial"]


@dataclass(frozen=True)
class ScheduleRule:
    """What one schedule decides; `SCHEDULES` holds each schedule's."""

    name: Schedule
    #: The run's max_staleness is its bound (at least 1): how far a row may
    #: lag the policy, or (partial) a group wait for its batch. Else the
    #: bound is 0: strictly on-policy.
    stale: bool
    #: Generation j starts once the engines serve version j - bound (else j).
    generates_ahead: bool
    #: Generations run beside each other, and a sync under them.
    in_flight: bool
    #: The generation task: partial rollouts (tasks/partial/task.py), else
    #: whole shards (tasks/generate.py).
    partial: bool

    def bound(self, max_staleness: int) -> int:
        """The staleness bound of a run of `max_staleness` (the one rule)."""
        if not self.stale:
            return 0
        if max_staleness < 1:
            raise ValueError(
                f"schedule {self.name!r} needs max_staleness >= 1, got {max_staleness}"
            )
        return max_staleness


SCHEDULES: dict[str, ScheduleRule] = {
    rule.name: rule
    for rule in (
        ScheduleRule("sync", stale=False, generates_ahead=False, in_flight=False, partial=False),
        ScheduleRule("overlap", stale=True, generates_ahead=True, in_flight=False, partial=False),
        ScheduleRule("in_flight", stale=True, generates_ahead=True, in_flight=True, partial=False),
        ScheduleRule("partial", stale=True, generates_ahead=False, in_flight=False, partial=True),
    )
}


@dataclass
class Pipeline:
    """The run's progress through its iterations. `trains=False` (a plain
    rollout job or an evaluation run): generations only, one after another."""

    iterations: int
    schedule: Schedule
    #: The run's bound (flows/params.py declares it): 0 under 'sync'.
    max_staleness: int
    trains: bool = True
    #: Iterations whose rollouts are written.
    written: set[int] = field(default_factory=set)
    #: Iterations being generated, and the next one to start.
    generating: set[int] = field(default_factory=set)
    next_iteration: int = 0
    #: Training steps done: the policy's version.
    trained: int = 0
    training: int | None = None
    #: The version the engines serve (the newest sync that finished).
    served: int = 0
    syncing: bool = False
    #: A sync failed, past its own retries (which replace dead engines),
    #: while these generations ran: the next sync waits for all of them.
    sync_held_for: set[int] = field(default_factory=set)
    #: Seconds the engines (no generation) and the policy (neither training
    #: nor syncing) were idle before each iteration's generation / training.
    engine_idle_s: dict[int, float] = field(default_factory=dict)
    policy_idle_s: dict[int, float] = field(default_factory=dict)
    #: Seconds nothing ran but the policy's start (a colocated policy starts
    #: after the engines): start-up, not the engines' idle time.
    startup_wait_s: float = 0.0
    _engines_free_since: float | None = None
    _policy_free_since: float | None = None
    _policy_idle_owed: float = 0.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {self.schedule!r}")
        if (bound := self.rule.bound(self.max_staleness)) != self.max_staleness:
            raise ValueError(
                f"schedule {self.schedule!r} has max_staleness {bound}, got {self.max_staleness}"
            )

    @property
    def rule(self) -> ScheduleRule:
        return SCHEDULES[self.schedule]

    # --- decisions ---------------------------------------------------------------
    def next_generation(self) -> int | None:
        """The iteration to generate now, or None."""
        j = self.next_iteration
        if j >= self.iterations:
            return None
        concurrent = self.trains and self.rule.in_flight
        if self.generating and not concurrent:
            return None
        if not self.trains:
            return j
        if self.syncing and not concurrent:
            return None  # overlap: the sync has the engines to itself
        lag = self.max_staleness if self.rule.generates_ahead else 0
        return j if self.served >= j - lag else None

    def next_training(self) -> int | None:
        """The iteration to train on now, or None."""
        j = self.trained
        if not self.trains or self.training is not None or self.syncing:
            return None
        return j if j in self.written else None

    def should_sync(self) -> bool:
        """Whether to push the policy's newest version to the engines now."""
        if not self.trains or self.syncing or self.training is not None:
            return False
        if self.trained <= self.served or self.sync_held_for:
            return False
        return not self.generating or self.rule.in_flight

    @property
    def done(self) -> bool:
        busy = bool(self.generating) or self.training is not None or self.syncing
        finished = len(self.written) == self.iterations
        if self.trains:
            finished = finished and self.trained == self.iterations == self.served
        return finished and not busy

    # --- events (`now`: a monotonic clock) --------------------------------------------
    def start(self, now: float) -> None:
        self._engines_free_since = self._policy_free_since = now

    def generation_started(self, iteration: int, now: float) -> None:
        if iteration != self.next_iteration:
            raise RuntimeError(f"generation {iteration} started, {self.next_iteration} was next")
        # Beside a running generation the engines were not idle.
        idle = 0.0 if self.generating else now - self._engines_free_since
        self.engine_idle_s[iteration] = idle
        self.generating.add(iteration)
        self.next_iteration += 1

    def generation_done(self, iteration: int, now: float) -> None:
        self.generating.remove(iteration)
        self.sync_held_for.discard(iteration)
        self.written.add(iteration)
        if not self.generating:
            self._engines_free_since = now

    def policy_up(self, now: float) -> None:
        """The policy came up: engines free since before waited for it."""
        if not self.generating:
            self.startup_wait_s += now - self._engines_free_since
            self._engines_free_since = now
        self._policy_free_since = now

    def engines_busy(self, now: float) -> None:
        """The engines ran work left from a generation until `now` (`partial`:
        the groups not taken generate while the policy trains)."""
        if not self.generating:
            self._engines_free_since = max(self._engines_free_since, now)

    def training_started(self, iteration: int, now: float) -> None:
        self.training = iteration
        self.policy_idle_s[iteration] = self._policy_idle_owed + now - self._policy_free_since
        self._policy_idle_owed = 0.0

    def training_done(self, version: int, now: float) -> None:
        self.trained += 1
        if version != self.trained:
            raise RuntimeError(f"policy at version {version} after {self.trained} steps")
        self.training = None
        self._policy_free_since = now

    def sync_started(self, now: float) -> None:
        self.syncing = True
        self._policy_idle_owed += now - self._policy_free_since

    def sync_done(self, version: int, now: float) -> None:
        self.syncing = False
        self.served = max(self.served, version)
        self._policy_free_since = now

    def sync_failed(self, now: float) -> bool:
        """A sync failed past its own retries. True when generations run (the
        next sync then waits for all of them; their retries replace engines
        too); False: nothing will change, the caller re-raises."""
        self.syncing = False
        self._policy_free_since = now
        if not self.generating:
            return False
        self.sync_held_for = set(self.generating)
        return True
