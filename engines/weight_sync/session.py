"""The engine actor's side of weight sync: `WeightSync`, composed by the
engine actor (`RolloutEngine.weights`), with the two-phase session every
transport runs inside (on top of `EngineWeights`, what holds between syncs;
one open sync's state and watchdog are `open_sync.OpenSync`).

A sync is a session: `begin_weight_sync` (check the manifest, then pause
generation and optionally back the weights up) -> one or more receives (the
transports' engine methods, run through `receive`) -> `finish_weight_sync`
(verify checksums, reset the prefix cache, stamp the new version, resume,
then the probe beside the first work let in: `probe.ProbeRuns`) or
`abort_weight_sync` (restore the backup, or mark the engine stale; then
resume, so requests get a clear error instead of a hang). Nothing is served
between begin and finish, so no request sees a mix of versions. If the
trainer disappears between calls, a watchdog aborts a session that has had
no call running for `idle_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel, ValidationError

from engines.errors import EngineFailure
from engines.weight_sync.config import ON_FAILURE
from engines.weight_sync.errors import (
    WeightSyncError,
    WeightTransferError,
    WeightVersionError,
)
from engines.weight_sync.factory import transports
from engines.weight_sync.formats.checksum import raise_checksum_mismatch
from engines.weight_sync.formats.manifest import raise_problems
from engines.weight_sync.open_sync import OpenSync
from engines.weight_sync.probe import ProbeReference, ProbeResult, ProbeRuns
from engines.weight_sync.protocol import (
    Begun,
    Committed,
    EngineHost,
    OneCall,
    Received,
    WeightStatus,
    WorkerAnswer,
)
from engines.weight_sync.session_abort import SessionAbort

logger = logging.getLogger(__name__)


def validated(model: type[BaseModel], data: Any, engine: str) -> Any:
    """`data` checked against `model`, before anything is touched."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise WeightSyncError(f"engine {engine}: invalid {model.__name__}: {exc}") from exc


class WeightSync(SessionAbort):
    """Weight sync on one engine actor. Transports' engine methods take it as
    their first argument and run their worker calls through `receive`."""

    def __init__(self, host: EngineHost):
        super().__init__(host)
        self.probes = ProbeRuns(host, self.name)
        # The receives `begin_and_receive` may run, by name.
        self._one_call = {m: t.engine_methods[m] for t in transports() for m in t.one_call}

    async def weight_status(self) -> WeightStatus:
        """Version served, staleness, and the version being synced (if any)."""
        open_ = self.open
        return WeightStatus(
            self.name,
            self.host.weight_version,
            self.host.stale,
            open_.version if open_ is not None else None,
        )

    # --- the session -------------------------------------------------------------------
    async def begin_weight_sync(
        self,
        version: int,
        manifest: dict | None = None,
        *,
        on_failure: str = "stale",
        idle_timeout_s: float | None = None,
        allow_partial: bool = False,
        wake: list[str] | None = None,
    ) -> Begun:
        """Open a sync to `version`: check it and the manifest first (a bad one
        raises and changes nothing), then pause generation, wake the `wake`
        tags (e.g. ["weights"] of an engine put to sleep during training)
        and, with `on_failure="restore"`, back the weights up. If no call
        comes for `idle_timeout_s` (default: the engine's RPC timeout), the
        sync is aborted."""
        host = self.host
        if isinstance(version, bool) or not isinstance(version, int):
            raise WeightVersionError(f"version must be an integer, got {version!r}")
        # Versions never go back. Re-sending the version served is allowed: it
        # repairs a stale engine or brings a replaced engine in line.
        if version < host.weight_version:
            raise WeightVersionError(
                f"engine {self.name} serves version {host.weight_version}; a sync must "
                f"not go back to {version}"
            )
        if on_failure not in ON_FAILURE:
            raise WeightSyncError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
        if manifest is not None:
            await self.check_weight_manifest(manifest, allow_partial)
        await self.probes.settled()  # the last commit's probe reads the weights replaced
        # Checked and claimed with no await in between: one sync at a time.
        if self.open is not None:
            raise WeightSyncError(
                f"engine {self.name} is already syncing to version {self.open.version}; "
                "finish or abort it first"
            )
        session = OpenSync(version, on_failure, self.rpc_timeout(idle_timeout_s))
        self.open = session
        try:
            async with session.call():
                started = time.monotonic()
                await host.pause_generation()
                paused = time.monotonic()
                if wake:
                    await host.wake_up(wake)
                # The workers have nothing to prepare unless they back up, or
                # report which weight group they are in (one call saved per sync).
                backup = on_failure == "restore"
                prepared = None
                if backup or self.in_group:
                    prepared = await self.rpc("prepare_weight_sync", backup)
                    session.worker_state = backup
        except BaseException:
            self.open = None
            await host.resume_generation()
            raise
        session.start_watchdog(self._expire)
        logger.info("engine %s: sync to version %d begun", self.name, version)
        workers = host.config.tensor_parallel_size
        return Begun(
            self.name,
            version,
            backup_bytes=sum(p["backup_bytes"] for p in prepared or []),
            group_ids=tuple(p["group_id"] for p in prepared) if prepared else (None,) * workers,
            pause_s=paused - started,
            prepare_s=time.monotonic() - paused,
        )

    def session(self, version: int | None = None) -> OpenSync:
        session = self.open
        if session is None:
            raise WeightSyncError(
                f"engine {self.name} has no weight sync open: call begin_weight_sync"
            )
        if version is not None and version != session.version:
            raise WeightVersionError(
                f"engine {self.name} is syncing to version {session.version}, not {version}"
            )
        return session

    async def receive(
        self,
        method: str,
        *args: Any,
        session: OpenSync | None = None,
        timeout_s: float | None = None,
    ) -> Received:
        """Run the worker method `method` inside the open sync; on failure
        abort it (restore or mark stale) and raise a typed error."""
        session = session or self.session()
        async with session.call(), self._lock:
            try:
                plain = await self.host.collective_rpc(method, args=args, timeout_s=timeout_s)
            except BaseException as exc:
                session.touched = True  # unknown how far the workers got
                await self._abort(session, f"{method} failed: {exc}", locked=True)
                if isinstance(exc, WeightSyncError | EngineFailure) or not isinstance(
                    exc, Exception
                ):
                    raise
                raise WeightTransferError(f"engine {self.name}: {method} failed: {exc}") from exc
            answers = [WorkerAnswer.of(a) for a in plain]
            session.worker_state |= any(a.holds_sync_state for a in answers)
            problems = [p for a in answers for p in a.problems]
            if problems:
                await self._abort(session, "manifest mismatch", locked=True)
                raise_problems(self.name, problems)
            session.touched = True
        session.nbytes += max((a.bytes for a in answers), default=0)
        # Each worker's checksums are checked (each receives every byte), each
        # worker's copy event is waited on.
        first = answers[0]
        return Received(
            self.name,
            bytes=first.bytes,
            checksums=tuple(a.checksums for a in answers) if first.checksums is not None else None,
            copies_done=(
                tuple(a.copies_done for a in answers) if first.copies_done is not None else None
            ),
            times=first.times,
        )

    async def begin_and_receive(
        self,
        version: int,
        manifest: dict | None,
        receive: str,
        args: list,
        *,
        commit: bool = False,
        on_failure: str = "stale",
        idle_timeout_s: float | None = None,
        allow_partial: bool = False,
        wake: list[str] | None = None,
        wake_after: list[str] | None = None,
        probe: ProbeReference | None = None,
    ) -> OneCall:
        """`begin_weight_sync`, then the receive `receive(*args)`, in one call;
        with `commit`, `finish_weight_sync(wake=wake_after)` too. For receives
        that pull the bytes themselves (CUDA IPC, a checkpoint): the trainer
        needs nothing from begin before the bytes can move, so a round trip
        is saved. `commit` is for a sync with nothing to agree on between
        receive and commit: one engine, nothing to verify (`probe` goes to the
        commit). Any failure aborts the sync here and raises."""
        started = time.monotonic()
        method = self._one_call.get(receive)
        if method is None:
            raise WeightSyncError(
                f"begin_and_receive takes one of {sorted(self._one_call)}, not {receive!r}"
            )
        begun = await self.begin_weight_sync(
            version,
            manifest,
            on_failure=on_failure,
            idle_timeout_s=idle_timeout_s,
            allow_partial=allow_partial,
            wake=wake,
        )
        try:
            received = await method(self, *args)
            received_at = time.monotonic()
            committed = None
            if commit:
                committed = await self.finish_weight_sync(version, wake=wake_after, probe=probe)
        except BaseException as exc:
            # Failures inside the session already aborted it; this closes
            # one raised before (bad arguments). Idempotent.
            await self.abort_weight_sync(f"{receive} failed: {exc}")
            raise
        probed = committed.probe if committed is not None else None
        ended = time.monotonic()
        return OneCall(
            begun, received, commit, ended - started, probed, (started, received_at, ended)
        )

    async def verify_weight_sync(self, version: int, checksums: dict[str, str]) -> int:
        """Compare the checksums of this engine's weights with the trainer's
        (`{name: checksum}`); a mismatch aborts the sync and raises. Returns
        how many were compared."""
        session = self.session(version)
        async with session.call(), self._lock:
            try:
                per_worker = await self.rpc("weight_checksums", list(checksums))
                raise_checksum_mismatch(f"engine {self.name}", checksums, per_worker)
            except BaseException as exc:
                await self._abort(session, str(exc), locked=True)
                raise
        return len(checksums)

    async def finish_weight_sync(
        self,
        version: int,
        checksums: dict[str, str] | None = None,
        wake: list[str] | None = None,
        probe: ProbeReference | None = None,
    ) -> Committed:
        """Verify (when `checksums` are given), wake the `wake` tags (e.g.
        ["kv_cache"] after a sync into a sleeping engine), reset the prefix
        cache, serve `version`, resume; the `probe` (`probe.ProbeRuns`) rides
        with the first work let in, and this returns with its verdict. A
        checksum mismatch or a failure to wake aborts the sync and raises."""
        host = self.host
        if checksums:
            await self.verify_weight_sync(version, checksums)
        session = self.session(version)
        verdict = None
        async with session.call(), self._lock:
            try:
                if session.worker_state:
                    await self.rpc("end_weight_sync", False)
                if wake:
                    await host.wake_up(wake)
            except BaseException as exc:
                await self._abort(session, f"finishing failed: {exc}", locked=True)
                raise
            session.stop_watchdog()
            self.open = None
            await host.reset_prefix_cache()
            previous, host.weight_version = host.weight_version, version
            host.stale = False
            if probe is None:
                await host.resume_generation()
            else:
                verdict = await self.probes.resume(probe, version, previous)
        logger.info("engine %s: now serving weight version %d", self.name, version)
        probed = ProbeResult("skipped", note="no reference from the trainer")
        probed = probed if verdict is None else await asyncio.shield(verdict)
        return Committed(self.name, version, session.nbytes, bool(checksums), probed)
