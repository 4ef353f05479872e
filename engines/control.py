"""The engine actor's control of its work, written on a class its backends
inherit (`RolloutEngine(ControlApi, ...)`): sleep and wake (vLLM's tags),
pause and resume (the door of `engines.admission`), and the hold on outputs
while a sync's probe checks the weights. A backend supplies the steps
(`_freeze`, `_thaw`, `_abort_requests`, `sleep`, `wake_up`, `probe_logprobs`).
"""

from __future__ import annotations

import abc

from engines.admission import Admission
from engines.errors import RequestError

# What sleep releases and `wake_up(tags)` restores (vLLM's tag names).
SLEEP_TAGS = frozenset({"weights", "kv_cache"})


def check_sleep_level(level: int) -> None:
    if level not in (1, 2):
        raise RequestError(f"sleep level must be 1 or 2, got {level!r}")


def wake_tags(tags: list[str] | None) -> set[str]:
    """The tags a `wake_up(tags)` call wakes (all when None)."""
    chosen = set(tags) if tags is not None else set(SLEEP_TAGS)
    unknown = chosen - SLEEP_TAGS
    if unknown:
        raise RequestError(f"unknown wake_up tags {sorted(unknown)}; use {sorted(SLEEP_TAGS)}")
    return chosen


class ControlApi(abc.ABC):
    """Pause, sleep and the output hold; `RolloutEngine.__init__` builds the
    `Admission` they close and open."""

    _admission: Admission

    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> None: ...

    @abc.abstractmethod
    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def wait_gpu_room(self, timeout_s: float) -> float:
        """Before `wake_up` on a shared GPU: wait until it has room for what
        waking allocates; returns the seconds waited. No GPU: nothing to wait for."""
        return 0.0

    async def pause_generation(self, mode: str = "keep") -> None:
        """Stop admitting new work; requests in flight are frozen where they
        are ("keep", the default, as OpenRLHF's), run to completion ("wait")
        or aborted ("abort"). Returns once no request runs a forward pass
        (see `engines.admission`)."""
        try:
            await self._admission.close(mode)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc

    async def resume_generation(self) -> None:
        """Undo one `pause_generation`: the last one lets frozen requests
        continue (recording the version now served) and new ones in."""
        await self._admission.open()

    @abc.abstractmethod
    async def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        """Logprobs of `token_ids[1:]` on the weights loaded, run past the
        door (a sync's probe, alongside the first requests let in after it);
        None when the backend cannot run a request now."""

    def served_quantization(self) -> str | None:
        """The format this engine rounds the weights it is sent to, beyond
        their dtype (vLLM's online "fp8"): the probe's tolerance widens for
        it. None: the dtype sent is what it serves."""
        return None

    def hold_outputs(self) -> None:
        """Hold every output computed from now (and by the requests inside)
        until `release_outputs`: a sync's probe has yet to pass the weights."""
        self._admission.hold()

    def release_outputs(self, error: BaseException | None) -> None:
        """The probe's verdict: the held outputs go out, or (`error`, the
        engine marked stale first) each of their calls raises it."""
        self._admission.settle(error)

    @abc.abstractmethod
    async def _freeze(self) -> None:
        """Stop every request in flight between two steps; return once none is in one."""

    @abc.abstractmethod
    async def _thaw(self) -> None: ...

    @abc.abstractmethod
    async def _abort_requests(self) -> None:
        """End every request in flight now, with finish_reason "abort"."""
