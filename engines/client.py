"""Fan control calls out to every engine, each with a deadline.

Ray's failures are mapped onto our error types here, once: an actor that died
is `EngineDeadError`, a deadline passed is `EngineTimeoutError`, and an error
raised by the engine's own code is re-raised as itself (e.g. PromptTooLongError).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray import exceptions as ray_exc

from engines import env
from engines.errors import EngineDeadError, EngineFailure, EngineTimeoutError


@dataclass
class EngineCallResult:
    engine: int
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def engine_label(engines: Any, index: int) -> str:
    names = getattr(engines, "names", None)
    return names[index] if names and index < len(names) else f"engine {index}"


def translate_error(exc: BaseException, label: str) -> BaseException:
    """Ray's exception -> ours (dead / timeout), or the engine's own error."""
    if isinstance(exc, ray_exc.GetTimeoutError):
        return EngineTimeoutError(f"{label} did not answer in time: {exc}", engine=label)
    if isinstance(exc, ray_exc.RayActorError | ray_exc.ActorUnavailableError):
        return EngineDeadError(f"{label} died: {exc}", engine=label)
    if isinstance(exc, ray_exc.RayTaskError):
        cause = exc.cause if exc.cause is not None else exc
        if isinstance(cause, EngineFailure) and cause.engine is None:
            cause.engine = label
        return cause
    return exc


def get(ref: Any, timeout_s: float | None = None, label: str = "engine") -> Any:
    """`ray.get` with a deadline and our error types."""
    timeout = env.rpc_timeout_s() if timeout_s is None else timeout_s
    try:
        return ray.get(ref, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - translated and re-raised
        raise translate_error(exc, label) from exc


def collect(
    refs: list[Any],
    labels: list[str],
    what: str,
    timeout_s: float,
    *,
    late_error: Callable[[str], BaseException] | None = None,
) -> list[EngineCallResult]:
    """Wait for every ref under one deadline: one result per ref, in order,
    holding its value or our error (`translate_error`). A ref still running
    at the deadline is cancelled and gets `late_error(message)` (default:
    EngineTimeoutError naming its label)."""
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
    results = []
    for i, (ref, label) in enumerate(zip(refs, labels, strict=True)):
        if ref not in ready:
            ray.cancel(ref, force=False)
            message = f"{label}: {what} took longer than {timeout_s:g}s"
            late = late_error(message) if late_error else EngineTimeoutError(message, label)
            results.append(EngineCallResult(i, error=late))
            continue
        try:
            results.append(EngineCallResult(i, value=ray.get(ref, timeout=0)))
        except Exception as exc:  # noqa: BLE001 - kept per ref
            results.append(EngineCallResult(i, error=translate_error(exc, label)))
    return results


def call_engines(
    engines: list[Any],
    method: str,
    *args: Any,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> list[EngineCallResult]:
    """Call `method` on every engine at once; one result (value or error) per engine,
    all within one shared deadline."""
    timeout = env.rpc_timeout_s() if timeout_s is None else timeout_s
    refs = [getattr(engine, method).remote(*args, **kwargs) for engine in engines]
    labels = [engine_label(engines, i) for i in range(len(engines))]
    return collect(refs, labels, method, timeout)


def raise_first_error(results: list[EngineCallResult]) -> list[Any]:
    """Values of all results, or the first engine's error."""
    for result in results:
        if not result.ok:
            raise result.error
    return [result.value for result in results]
