"""Where an engine's start-up time goes: phases timed inside the engine actor
(and, for vLLM, its own split read from its log: `engines.vllm.startup_log`).

The actor's clock starts when its process begins importing this package
(`engines/__init__.py` records the moment before anything else), so the
driver can tell Ray's part (scheduling, worker process, runtime_env: from
its submission to `imports_started`) from ours. Times are wall-clock
(`time.time()`): the benchmark compares them with the driver's, on one host.

Also the start-up steps both backends take: waiting for their turn on a
shared GPU (`wait_turn`), a prepared actor's wait for the engines before its
imports (`wait_engines_up`) and the tokenizer-against-model check
(`warn_vocab_mismatch`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

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
    #: Seconds the engine core's fork waited for the forkserver's imports
    #: (`engines.vllm.forkserver.fork_waits`), inside the "engine" phase.
    fork_wait_s: float | None = None

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
        self,
        engine: str,
        backend: str,
        vllm_phases: tuple[Phase, ...] = (),
        fork_wait_s: float | None = None,
    ) -> StartupReport:
        return StartupReport(
            engine=engine,
            backend=backend,
            imports_started=self.began,
            ready_at=self.last,
            phases=tuple(self.phases),
            vllm_phases=vllm_phases,
            fork_wait_s=fork_wait_s,
        )


def actor_clock() -> StartupClock:
    """A clock started when this process began importing `engines` (now, if
    that moment was not recorded), with the imports up to now as its first phase."""
    clock = StartupClock(IMPORTS_STARTED)
    clock.mark("imports")
    return clock


def wait_turn(after: list[Any], timeout_s: float, name: str, clock: StartupClock) -> None:
    """Engines that share a GPU start one at a time: vLLM sizes its KV cache
    from the GPU's free memory before and after a profiling pass, so one
    engine's allocations (or a spare's sleep) during another's profiling
    leave it without a KV cache ("No available memory for the cache
    blocks"). `after`: the object whose readiness is this engine's turn
    (the previous engine's `ready`, a spare's sleep); its outcome does not
    matter, a failed predecessor frees its memory too."""
    import ray

    done, _ = ray.wait(list(after), timeout=timeout_s)
    if not done:
        logger.warning("engine %s starts after %gs without its turn on the GPU", name, timeout_s)
    clock.mark("its turn on a shared GPU: the engine before it up")


def wait_engines_up(after: list[Any], timeout_s: float, clock: StartupClock) -> None:
    """A prepared actor's imports (`engines.lifecycle.prepared`) wait for the
    engines it may replace, or the one it follows, to be up: they would take
    CPU from those engines' start (vLLM's import is some 20 s of a core).
    `after`: their `ready` refs; their outcome does not matter."""
    import ray

    ray.wait(list(after), num_returns=len(after), timeout=timeout_s)
    clock.mark("the engines up (a prepared actor's imports wait for them)")


def warn_vocab_mismatch(engine: str, tokenizer_size: int, model_vocab: int, rows: int) -> None:
    """At start-up: a tokenizer with more tokens than the model's vocabulary
    (tokens added to it, the model's embeddings not resized with it) has ids
    the engine cannot serve, and a trainer that resized its embeddings for
    them will have its sync refused. A vocabulary larger than the tokenizer
    is padding (vLLM pads its rows to a multiple of 64; the tiny model and
    many checkpoints ship padded): nothing is wrong, nothing is warned.
    Warned by each engine; Ray folds the same line from many actors."""
    if tokenizer_size <= model_vocab:
        return
    logger.warning(
        "engine %s: the tokenizer has %d tokens, the model's vocab_size is %d and the "
        "engine holds %d embedding rows: token ids >= %d cannot be served, and a trainer "
        "whose embeddings were resized to the tokenizer's size will have its sync refused: "
        "save the resized model with its tokenizer and create the engines from it",
        engine,
        tokenizer_size,
        model_vocab,
        rows,
        model_vocab,
    )
