"""Where an engine's start-up time goes: phases timed inside the engine actor,
plus vLLM's own split read from the log lines its engine core writes.

The actor's clock starts when its process begins importing this package
(`engines/__init__.py` records the moment before anything else), so the
driver can tell Ray's part (scheduling, worker process, runtime_env: from
its submission to `imports_started`) from ours. Times are wall-clock
(`time.time()`): the benchmark compares them with the driver's, on one host.
"""

from __future__ import annotations

import os
import re
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


# vLLM 0.26.0's start-up log lines (the engine core and its GPU worker):
# model_loader/default_loader.py, v1/worker/gpu_model_runner.py,
# compilation/backends.py and monitor.py, v1/engine/core.py.
VLLM_LOG_PHASES = (
    ("weight load", re.compile(r"Loading weights took ([\d.]+) seconds")),
    ("model load (weights included)", re.compile(r"Model loading took .*? and ([\d.]+) seconds")),
    ("dynamo bytecode transform", re.compile(r"Dynamo bytecode transform time: ([\d.]+) s")),
    ("torch.compile (total)", re.compile(r"torch\.compile took ([\d.]+) s in total")),
    ("CUDA graph capture", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
    (
        "profile + KV cache + warm-up (compile and graphs included)",
        re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    ),
)
#: Loaded from the compile cache instead of compiled (a warm start).
VLLM_CACHE_HIT = re.compile(r"Directly load the compiled graph")


def vllm_log_phases(text: str) -> tuple[Phase, ...]:
    """vLLM's start-up split from its log text (the first match of each line:
    with TP>1 every rank logs its own)."""
    phases = []
    for name, pattern in VLLM_LOG_PHASES:
        match = pattern.search(text)
        if match:
            phases.append(Phase(name, float(match.group(1))))
    if VLLM_CACHE_HIT.search(text):
        phases.append(Phase("compiled graphs loaded from the cache", 0.0))
    return tuple(phases)


class OwnLog:
    """This process's stdout and stderr when they are files (a Ray worker's
    log files, which vLLM's engine-core child process inherits), read from
    where they stood at construction: what the engine logged since."""

    def __init__(self) -> None:
        self.starts: dict[str, int] = {}
        for fd in (1, 2):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # not Linux, or closed
                continue
            if os.path.isfile(path):
                self.starts[path] = os.path.getsize(path)

    def read(self, limit: int = 4 << 20) -> str:
        chunks = []
        for path, start in self.starts.items():
            try:
                with open(path, errors="replace") as f:
                    f.seek(start)
                    chunks.append(f.read(limit))
            except OSError:
                continue
        return "\n".join(chunks)
