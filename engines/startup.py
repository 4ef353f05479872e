"""Where an engine's start-up time goes: phases timed inside the engine actor
(and, for vLLM, its own split read from its log: `engines.vllm.startup_log`).

The actor's clock starts when its process begins importing this package
(`engines/__init__.py` records the moment before anything else), so the
driver can tell Ray's part (scheduling, worker process, runtime_env: from
its submission to `imports_started`) from ours. Times are wall-clock
(`time.time()`): the benchmark compares them with the driver's, on one host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: Set by `engines/__init__.py` before its first import.
IMPORTS_STARTED: float | None = None


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float


@dataclass(frozen=True)
class StartupReport:
    """One engine's start-up, as `RolloutEngine.startup_report()` returns it."""

    engine: str
    backend: str
    #: Wall clock when the actor's process began importing `engines`.
    imports_started: float
    #: Wall clock when the engine could serve (end of `__init__`).
    ready_at: float
    #: Phases measured in the actor, in order; they sum to ready_at - imports_started.
    phases: tuple[Phase, ...]
    #: vLLM's own split (weights, torch.compile, CUDA graphs, ...), read from
    #: its log lines; these overlap the actor's "engine" phase.
    vllm_phases: tuple[Phase, ...] = field(default_factory=tuple)

    @property
    def seconds(self) -> float:
        return self.ready_at - self.imports_started


class StartupClock:
    """Marks phase boundaries inside the actor: `mark(name)` closes the phase
    that ran since the previous mark."""

    def __init__(self, began: float | None = None):
        self.began = began if began is not None else time.time()
        self.last = self.began
        self.phases: list[Phase] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self.phases.append(Phase(name, round(now - self.last, 3)))
        self.last = now

    def report(
        self, engine: str, backend: str, vllm_phases: tuple[Phase, ...] = ()
    ) -> StartupReport:
        return StartupReport(
            engine=engine,
            backend=backend,
            imports_started=self.began,
            ready_at=self.last,
            phases=tuple(self.phases),
            vllm_phases=vllm_phases,
        )


def actor_clock() -> StartupClock:
    """A clock started when this process began importing `engines` (now, if
    that moment was not recorded), with the imports up to now as its first phase."""
    clock = StartupClock(IMPORTS_STARTED)
    clock.mark("imports")
    return clock
