"""Two-phase sync over a set of engines, shared by every transport.

begin (all: check the manifest, then pause) -> transfer (the transport's
job; each engine returns checksums of what it received) -> verify (here,
against the trainer's) -> finish (all: reset prefix cache, new version,
resume). If anything fails before finish, every engine that began is aborted
(restored or marked stale) so no engine commits a version the others lack.
One control call per engine per phase: at small models the control calls,
not the bytes, are most of a sync. Where the engines pull the bytes
themselves (CUDA IPC, a checkpoint), begin rides on the transfer call, and
with one engine and nothing to verify so does finish: one call per sync.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from engines.client import EngineCallResult, call_engines, collect, engine_label
from engines.errors import EngineDeadError, EngineFailure
from engines.weight_sync.config import SyncConfig
from engines.weight_sync.errors import ChecksumMismatchError, WeightSyncError, WeightTransferError
from engines.weight_sync.formats.checksum import raise_checksum_mismatch
from engines.weight_sync.formats.manifest import Manifest
from engines.weight_sync.probe import ProbeReference, ProbeResult, combined
from engines.weight_sync.protocol import Begun, OneCall, SyncReport

logger = logging.getLogger(__name__)

Weights = Sequence[tuple[str, Any]]


def trainer_weights(weights: Any) -> list[tuple[str, Any]]:
    """`weights` ((HF name, tensor) pairs) as a list of detached tensors."""
    weights = list(weights)
    if not weights:
        raise ValueError("no weights to sync")
    return [(name, t.detach()) for name, t in weights]


class ManifestCache:
    """The manifest of the last weights seen, made again only when their
    names, dtypes or shapes change (most syncs send the same layout, and
    making one is not free at large models)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._manifest: Manifest | None = None

    def of(self, weights: list[tuple[str, Any]]) -> Manifest:
        key = tuple((name, t.dtype, tuple(t.shape)) for name, t in weights)
        if key != self._key:
            self._key, self._manifest = key, Manifest.of(weights)
        return self._manifest


class Phases:
    """Times each phase of a sync."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.times: dict[str, float] = {}
        self.engine_times: dict[str, float] = {}
        self._mark = self.started

    def engines_reported(self, answers: list[Any], *keys: str) -> None:
        """Keep the slowest engine's seconds for each of `keys` in the
        answers' `times`; a moment (`*_at`, on the host's monotonic clock,
        which every process of a host shares) as seconds since this sync began."""
        for key in keys:
            since = self.started if key.endswith("_at") else 0.0
            values = [a.times[key] - since for a in answers if key in a.times]
            if values:
                self.engine_times[key] = max(values)

    def done(self, phase: str) -> None:
        now = time.monotonic()
        self.times[phase] = now - self._mark
        self._mark = now

    @property
    def total(self) -> float:
        return time.monotonic() - self.started

    def report(
        self,
        version: int,
        transport: str,
        engines: int,
        *,
        nbytes: int,
        verified: bool,
        buckets: int = 0,
        probe: ProbeResult | None = None,
    ) -> SyncReport:
        """The report of the sync these phases timed, now done."""
        return SyncReport(
            version,
            transport,
            engines,
            bytes=nbytes,
            buckets=buckets,
            seconds=self.total,
            verified=verified,
            phases=self.times,
            engine_times=self.engine_times,
            probe=probe,
        )


def as_engine_list(engines: Any) -> list[Any]:
    """The engines as a list, keeping an `EngineSet`'s names for messages."""
    return engines if isinstance(engines, list) else list(engines)


def failure_of(engines: list[Any], results: list[EngineCallResult], what: str) -> Exception:
    """One error for a phase's failed results: EngineDeadError if an engine
    died (replace it), else the first engine's own (recoverable) error."""
    failed = [r for r in results if not r.ok]
    dead = [r for r in failed if isinstance(r.error, EngineDeadError)]
    if dead:
        names = [engine_label(engines, r.engine) for r in dead]
        error = EngineDeadError(
            f"{what}: engines {names} died; the others were aborted", engine=names[0]
        )
        error.__cause__ = dead[0].error
        return error
    first = failed[0].error
    if isinstance(first, WeightSyncError | EngineFailure):
        return first
    error = WeightTransferError(f"{what}: {engine_label(engines, failed[0].engine)}: {first}")
    error.__cause__ = first
    return error


class Coordinator:
    """One sync over `engines`. `probe`: the trainer's reference, which
    every engine checks in its commit (ignored with `config.probe` off)."""

    def __init__(self, engines: list[Any], config: SyncConfig, probe: ProbeReference | None = None):
        if not engines:
            raise ValueError("no engines to sync")
        self.engines = engines
        self.config = config
        self.probe = probe if config.probe else None
        self._probed: list[ProbeResult] = []
        self._open: list[int] = []

    def probe_result(self) -> ProbeResult:
        """What the probe did in this sync's commits, for its report."""
        if not self.config.probe:
            return ProbeResult("off")
        if self.probe is None:
            return ProbeResult("skipped", note="the trainer gave no reference")
        return combined(self._probed)

    def _call(self, method: str, *args: Any, only: list[int] | None = None, **kwargs: Any):
        indices = list(range(len(self.engines))) if only is None else only
        targets = [self.engines[i] for i in indices]
        results = call_engines(targets, method, *args, timeout_s=self.config.timeout_s, **kwargs)
        for result, index in zip(results, indices, strict=True):
            result.engine = index
        return results

    def begin(
        self,
        version: int,
        manifest: Manifest | None,
        allow_partial: bool = False,
        wake: list[str] | None = None,
    ) -> list[Begun]:
        """Open the sync on every engine (each checks the manifest before it
        pauses, then wakes `wake`); returns their answers, or aborts all and raises."""
        payload = manifest.plain if manifest is not None else None
        results = self._call(
            "begin_weight_sync",
            version,
            payload,
            on_failure=self.config.on_failure,
            idle_timeout_s=self.config.timeout_s,
            allow_partial=allow_partial,
            wake=wake,
        )
        self._open = [r.engine for r in results if r.ok]
        if len(self._open) != len(self.engines):
            error = failure_of(self.engines, results, f"begin sync to version {version}")
            self.abort(f"begin failed: {error}")
            raise error
        return [r.value for r in results]

    def begin_and_receive(
        self,
        version: int,
        manifest: Manifest | None,
        receive: str,
        args: tuple,
        *,
        allow_partial: bool = False,
        wake: list[str] | None = None,
        wake_after: list[str] | None = None,
        verified: bool = False,
    ) -> list[OneCall]:
        """Begin and a receive whose bytes the engines pull themselves (CUDA
        IPC, a checkpoint) in one call per engine. One engine with nothing
        for the trainer to verify also commits in that call (`wake_after`
        woken first): a sync with nobody to agree with needs no second
        phase. Otherwise `finish` (or `abort`) follows as usual; each answer
        says which (`committed`). Any failure aborts every engine and raises."""
        commit = len(self.engines) == 1 and not verified
        payload = manifest.plain if manifest is not None else None
        self._open = list(range(len(self.engines)))
        refs = [
            engine.begin_and_receive.remote(
                version,
                payload,
                receive,
                list(args),
                commit=commit,
                on_failure=self.config.on_failure,
                idle_timeout_s=self.config.timeout_s,
                allow_partial=allow_partial,
                wake=wake,
                wake_after=wake_after,
                probe=self.probe,
            )
            for engine in self.engines
        ]
        answers = self.collect(refs, f"sync to version {version} ({receive})")
        if commit:
            self._open = []
            self._probed = [a.probe for a in answers if a.probe is not None]
        return answers

    def collect(self, refs: list[Any], what: str) -> list[Any]:
        """Wait for one call per engine (already launched) within the deadline;
        on any failure abort all and raise."""
        labels = [engine_label(self.engines, i) for i in range(len(refs))]
        results = collect(refs, labels, what, self.config.timeout_s, late_error=WeightTransferError)
        if not all(r.ok for r in results):
            error = failure_of(self.engines, results, what)
            self.abort(f"{what} failed: {error}")
            raise error
        return [r.value for r in results]

    def check_received(self, version: int, expected: dict[str, str], answers: list[Any]) -> None:
        """Compare the checksums each engine's workers returned with their
        transfer against the trainer's, before any engine commits: one
        engine's mismatch aborts all, so the engines never serve different
        versions."""
        for index, answer in enumerate(answers):
            try:
                raise_checksum_mismatch(
                    engine_label(self.engines, index), expected, answer.checksums
                )
            except ChecksumMismatchError as error:
                self.abort(f"verify version {version} failed: {error}")
                raise

    def finish(self, version: int, wake: list[str] | None = None) -> None:
        """Commit on every engine (each wakes `wake` before it resumes)."""
        results = self._call(
            "finish_weight_sync", version, wake=wake, probe=self.probe, only=self._open
        )
        self._open = []
        self._probed = [r.value.probe for r in results if r.ok and r.value.probe is not None]
        if not all(r.ok for r in results):
            # Engines that failed here aborted themselves (or died); those that
            # committed serve the new version, consistently.
            raise failure_of(self.engines, results, f"finish sync to version {version}")

    def abort(self, reason: str) -> list[EngineCallResult]:
        """Abort the sync on every engine that began it (idempotent on each)."""
        if not self._open:
            return []
        results = self._call("abort_weight_sync", reason, only=self._open)
        self._open = []
        for r in results:
            if r.ok:
                logger.warning(
                    "aborted sync on %s: %s", engine_label(self.engines, r.engine), r.value
                )
            else:
                logger.error(
                    "abort on %s failed: %s", engine_label(self.engines, r.engine), r.error
                )
        return results
