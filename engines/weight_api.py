"""Weight-update methods of the engine actor (OpenRLHF names and our bucketed
path). They run on the actor and reach the workers via `collective_rpc`,
so one implementation serves both backends.

A sync is a session: `begin_weight_sync` (check the manifest, then pause
generation and optionally back the weights up) -> one or more receive calls
-> `finish_weight_sync` (verify checksums, reset the prefix cache, stamp the
new version, resume) or `abort_weight_sync` (restore the backup, or mark the
engine stale; then resume, so requests get a clear error instead of a hang).
Nothing is served between begin and finish, so no request sees a mix of
versions. `begin_and_receive` runs begin and a receive (and, for one engine,
finish) in one call, for receives that need nothing from the trainer after
begin. OpenRLHF's `update_weight` opens a session implicitly and its last
call (`empty_cache=True`, as OpenRLHF sends it) commits it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel, ValidationError

from engines.errors import EngineFailure
from engines.weight_sync import cuda_ipc
from engines.weight_sync.buckets import BucketPlan
from engines.weight_sync.checksum import raise_checksum_mismatch
from engines.weight_sync.config import ON_FAILURE
from engines.weight_sync.errors import (
    ManifestMismatchError,
    WeightSyncError,
    WeightTransferError,
    WeightVersionError,
)
from engines.weight_sync.manifest import Manifest, dtype_name
from engines.weight_sync.session import SyncSession

logger = logging.getLogger(__name__)


#: Receives `begin_and_receive` may run: those whose bytes the engine pulls
#: itself, so no trainer-side step has to follow begin.
ONE_CALL_RECEIVES = ("receive_shared_weights", "load_weights_from_path")


def raise_problems(engine: str, problems: list[str]) -> None:
    if problems:
        shown = "; ".join(dict.fromkeys(problems[:5]))
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ManifestMismatchError(f"engine {engine}: weight manifest mismatch: {shown}{more}")


def with_every_worker(results: list[dict], field: str) -> dict:
    """Rank 0's answer to a receive, with `field` (when the workers return
    it) as the list of every worker's: each worker's checksums are checked
    (each receives every byte), each worker's copy event is waited on."""
    answer = dict(results[0])
    if field in answer:
        answer[field] = [r[field] for r in results]
    return answer


def _validated(model: type[BaseModel], data: Any, engine: str) -> dict:
    """Plain data checked against `model`, before anything is touched."""
    try:
        return model.model_validate(data).model_dump(mode="json")
    except ValidationError as exc:
        raise WeightSyncError(f"engine {engine}: invalid {model.__name__}: {exc}") from exc


class WeightUpdateAPI:
    """Mixin of `RolloutEngine`; uses its `config`, `weight_version`, `stale`,
    `pause_generation`, `resume_generation`, `reset_prefix_cache` and
    `collective_rpc`."""

    _weight_session: SyncSession | None = None
    _weight_lock: asyncio.Lock | None = None
    _accepted_manifests: frozenset[tuple[str, bool]] = frozenset()
    _last_accepted: tuple[dict, bool] | None = None
    _last_plan: dict | None = None  # the bucket plan validated last
    _in_weight_group = False  # set by init_process_group, cleared by destroy_weight_group

    def _lock(self) -> asyncio.Lock:
        if self._weight_lock is None:
            self._weight_lock = asyncio.Lock()
        return self._weight_lock

    def _rpc_timeout(self, timeout_s: float | None) -> float:
        return float(timeout_s) if timeout_s is not None else float(self.config.rpc_timeout_s)

    # --- manifest and inspection --------------------------------------------------
    async def weight_manifest(self) -> dict:
        """The parameter layout (HF names) this engine accepts."""
        return (await self.collective_rpc("weight_manifest"))[0]

    async def check_weight_manifest(self, manifest: dict, allow_partial: bool = False) -> None:
        """Raise ManifestMismatchError, naming the parameter, if the trainer's
        manifest does not fit this engine. Changes nothing."""
        # Most syncs send the manifest accepted last time: a plain comparison,
        # no validation (a millisecond per sync at 7B).
        if self._last_accepted == (manifest, bool(allow_partial)):
            return
        checked = Manifest.model_validate(manifest)
        # A worker's layout never changes, so a manifest it accepted once is
        # accepted again without asking it (each sync sends one).
        key = (checked.digest(), bool(allow_partial))
        if key in self._accepted_manifests:
            self._last_accepted = (manifest, bool(allow_partial))
            return
        per_worker = await self.collective_rpc(
            "weight_manifest_problems", args=(checked.model_dump(mode="json"), bool(allow_partial))
        )
        raise_problems(self.config.name, [p for problems in per_worker for p in problems])
        self._accepted_manifests = self._accepted_manifests | {key}
        self._last_accepted = (manifest, bool(allow_partial))

    async def weight_checksums(self, names: list[str]) -> list[dict[str, str | None]]:
        """Per worker: checksums of the named weights (see the worker's doc)."""
        return await self.collective_rpc("weight_checksums", args=(list(names),))

    async def read_weights(self, names: list[str]) -> dict[str, Any]:
        """Rank 0's copies of the named weights (CPU tensors)."""
        return (await self.collective_rpc("read_weights", args=(list(names),)))[0]

    # --- the process group ------------------------------------------------------------
    async def init_process_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        use_ray: bool = False,
        timeout_s: float | None = None,
    ) -> list[int]:
        """Join the trainer's weight group (OpenRLHF's signature): worker of
        tensor-parallel rank r becomes rank `rank_offset + r`. Must run while the
        trainer (rank 0) creates its side. Returns the ranks taken."""
        if use_ray:
            # ray.util.collective has no timeout on its collectives, and every
            # collective here must have one.
            raise WeightSyncError("use_ray=True is not supported: use backend 'gloo' or 'nccl'")
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 1:
            raise WeightSyncError(
                f"rank_offset must be an integer >= 1 (0 is the trainer), got {rank_offset!r}"
            )
        ranks = await self.collective_rpc(
            "init_process_group",
            kwargs=dict(
                master_address=str(master_address),
                master_port=int(master_port),
                rank_offset=rank_offset,
                world_size=int(world_size),
                group_name=str(group_name),
                backend=backend,
                timeout_s=self._rpc_timeout(timeout_s),
            ),
        )
        self._in_weight_group = True
        return ranks

    async def destroy_weight_group(self) -> None:
        self._in_weight_group = False
        await self.collective_rpc("destroy_weight_group")

    async def release_shared_weights(self) -> None:
        """Drop the colocated trainer's tensors the workers kept between CUDA
        IPC syncs, so the trainer can free that memory."""
        await self.collective_rpc("release_shared_weights")

    async def has_weight_group(self) -> bool:
        return all(await self.collective_rpc("has_weight_group"))

    async def num_weight_workers(self) -> int:
        """Ranks this engine takes in a weight group (its tensor-parallel size)."""
        return len(await self.collective_rpc("has_weight_group"))

    async def weight_status(self) -> dict:
        """Version served, staleness, and the version being synced (if any)."""
        session = self._weight_session
        return {
            "engine": self.config.name,
            "version": self.weight_version,
            "stale": self.stale,
            "syncing": session.version if session is not None else None,
        }

    # --- the session ---------------------------------------------------------------------
    async def begin_weight_sync(
        self,
        version: int,
        manifest: dict | None = None,
        *,
        on_failure: str = "stale",
        idle_timeout_s: float | None = None,
        allow_partial: bool = False,
        wake: list[str] | None = None,
    ) -> dict:
        """Open a sync to `version`: check it and the manifest first (a bad one
        raises and changes nothing), then pause generation, wake the `wake`
        tags (e.g. ["weights"] of an engine put to sleep during training)
        and, with `on_failure="restore"`, back the weights up. If no call
        comes for `idle_timeout_s` (default: the engine's RPC timeout), the
        sync is aborted."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise WeightVersionError(f"version must be an integer, got {version!r}")
        # Versions never go back. Re-sending the version served is allowed: it
        # repairs a stale engine (a mix under that number) or brings a
        # replaced engine in line with the others.
        if version < self.weight_version:
            raise WeightVersionError(
                f"engine {self.config.name} serves version {self.weight_version}; a sync must "
                f"not go back to {version}"
            )
        if on_failure not in ON_FAILURE:
            raise WeightSyncError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
        if manifest is not None:
            await self.check_weight_manifest(manifest, allow_partial)
        # Checked and claimed with no await in between: one sync at a time.
        if self._weight_session is not None:
            raise WeightSyncError(
                f"engine {self.config.name} is already syncing to version "
                f"{self._weight_session.version}; finish or abort it first"
            )
        session = SyncSession(version, on_failure, self._rpc_timeout(idle_timeout_s))
        self._weight_session = session
        try:
            async with session.call():
                started = time.monotonic()
                await self.pause_generation()
                paused = time.monotonic()
                if wake:
                    await self.wake_up(wake)
                # The workers have nothing to prepare unless they back up, or
                # report which weight group they are in (one call saved per sync).
                backup = on_failure == "restore"
                prepared = None
                if backup or self._in_weight_group:
                    prepared = await self.collective_rpc("prepare_weight_sync", args=(backup,))
                    session.worker_state = backup
        except BaseException:
            self._weight_session = None
            await self.resume_generation()
            raise
        session.start_watchdog(self._expire)
        logger.info("engine %s: sync to version %d begun", self.config.name, version)
        return {
            "engine": self.config.name,
            "version": version,
            "backup_bytes": sum(p["backup_bytes"] for p in prepared or []),
            # Per worker: the weight group it is in, so a trainer learns
            # whether its group is intact without another call.
            "group_ids": (
                [p["group_id"] for p in prepared]
                if prepared is not None
                else [None] * self.config.tensor_parallel_size
            ),
            "pause_s": paused - started,
            "prepare_s": time.monotonic() - paused,
        }

    def _session(self, version: int | None = None) -> SyncSession:
        session = self._weight_session
        if session is None:
            raise WeightSyncError(
                f"engine {self.config.name} has no weight sync open: call begin_weight_sync"
            )
        if version is not None and version != session.version:
            raise WeightVersionError(
                f"engine {self.config.name} is syncing to version {session.version}, not {version}"
            )
        return session

    async def _in_session(
        self,
        method: str,
        *args: Any,
        session: SyncSession | None = None,
        timeout_s: float | None = None,
    ):
        """Run a receive on the workers; on failure abort the session (restore
        or mark stale) and raise a typed error."""
        session = session or self._session()
        async with session.call(), self._lock():
            try:
                results = await self.collective_rpc(method, args=args, timeout_s=timeout_s)
            except BaseException as exc:
                session.touched = True  # unknown how far the workers got
                await self._abort(session, f"{method} failed: {exc}", locked=True)
                if isinstance(exc, WeightSyncError | EngineFailure) or not isinstance(
                    exc, Exception
                ):
                    raise
                raise WeightTransferError(
                    f"engine {self.config.name}: {method} failed: {exc}"
                ) from exc
            session.worker_state |= any(
                not isinstance(r, dict) or r.get("holds_sync_state", True) for r in results
            )
            problems = [p for r in results if isinstance(r, dict) for p in r.get("problems", [])]
            if problems:
                await self._abort(session, "manifest mismatch", locked=True)
                raise_problems(self.config.name, problems)
            session.touched = True
        session.nbytes += max(
            (r.get("bytes", 0) for r in results if isinstance(r, dict)), default=0
        )
        return results

    async def receive_weight_buckets(self, plan: dict, verify: bool = True) -> dict:
        """Receive a whole bucket plan over the weight group (the trainer
        broadcasts the buckets right after calling this)."""
        # Most syncs send the plan of the last one: a comparison, no validation.
        if plan != self._last_plan:
            self._last_plan = _validated(BucketPlan, plan, self.config.name)
        plan = self._last_plan
        # One call receives every bucket: the deadline grows with their number.
        timeout = self._rpc_timeout(None) * max(1, len(plan["buckets"]))
        results = await self._in_session(
            "receive_weight_buckets", plan, bool(verify), timeout_s=timeout
        )
        return with_every_worker(results, "checksums")

    async def receive_shared_weights(
        self, mapping: str, shared: bytes | None, keep: bool, signal: bool = False
    ) -> dict:
        """Load the colocated trainer's weights straight from its GPU memory
        (CUDA IPC). `shared` carries the tensors' handles (`CudaIpcSender`),
        or is None to reuse the tensors of `mapping` that the workers kept
        from the last sync (`keep`). With `signal` (and `keep`) the workers
        answer before their copies finish: `copies_done` lists one CUDA
        event handle per worker for the trainer to wait on."""
        if shared is not None and not isinstance(shared, bytes):
            raise WeightSyncError(f"engine {self.config.name}: shared handles must be bytes")
        results = await self._in_session(
            "receive_shared_weights", str(mapping), shared, bool(keep), bool(signal)
        )
        return with_every_worker(results, "copies_done")

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
    ) -> dict:
        """`begin_weight_sync`, then the receive `receive(*args)`, in one call;
        with `commit`, `finish_weight_sync(wake=wake_after)` too. For receives
        that pull the bytes themselves (CUDA IPC, a checkpoint): the trainer
        needs nothing from begin before the bytes can move, so a round trip
        is saved (each costs 2-5 ms on an H200 host, docs/benchmarks.md).
        `commit` is for a sync with nothing to agree on between receive and
        commit: one engine, nothing to verify. Any failure aborts the sync
        here and raises."""
        started = time.monotonic()
        if receive not in ONE_CALL_RECEIVES:
            raise WeightSyncError(
                f"begin_and_receive takes one of {ONE_CALL_RECEIVES}, not {receive!r}"
            )
        answer = await self.begin_weight_sync(
            version,
            manifest,
            on_failure=on_failure,
            idle_timeout_s=idle_timeout_s,
            allow_partial=allow_partial,
            wake=wake,
        )
        try:
            answer.update(await getattr(self, receive)(*args))
            if commit:
                await self.finish_weight_sync(version, wake=wake_after)
        except BaseException as exc:
            # Failures inside the session already aborted it; this closes
            # one raised before (bad arguments). Idempotent.
            await self.abort_weight_sync(f"{receive} failed: {exc}")
            raise
        answer.update(committed=commit, call_s=time.monotonic() - started)
        return answer

    async def load_weights_from_path(self, path: str, verify: bool = True) -> dict:
        """Load a safetensors checkpoint directory (HF layout) into the open sync."""
        return with_every_worker(
            await self._in_session("load_weights_from_path", str(path), bool(verify)), "checksums"
        )

    async def verify_weight_sync(self, version: int, checksums: dict[str, str]) -> dict:
        """Compare the checksums of this engine's weights with the trainer's
        (`{name: checksum}`); a mismatch aborts the sync and raises."""
        session = self._session(version)
        async with session.call(), self._lock():
            try:
                await self._verify(checksums)
            except BaseException as exc:
                await self._abort(session, str(exc), locked=True)
                raise
        return {"engine": self.config.name, "version": version, "verified": len(checksums)}

    async def finish_weight_sync(
        self,
        version: int,
        checksums: dict[str, str] | None = None,
        wake: list[str] | None = None,
    ):
        """Verify (when `checksums` are given), wake the `wake` tags (e.g.
        ["kv_cache"] after a sync into a sleeping engine), reset the prefix
        cache, serve `version`, resume. A checksum mismatch, or a failure to
        wake, aborts the sync and raises."""
        if checksums:
            await self.verify_weight_sync(version, checksums)
        session = self._session(version)
        async with session.call(), self._lock():
            try:
                if session.worker_state:
                    await self.collective_rpc("end_weight_sync", args=(False,))
                if wake:
                    await self.wake_up(wake)
            except BaseException as exc:
                await self._abort(session, f"finishing failed: {exc}", locked=True)
                raise
            session.stop_watchdog()
            self._weight_session = None
            await self.reset_prefix_cache()
            self.weight_version = version
            self.stale = False
            await self.resume_generation()
        logger.info("engine %s: now serving weight version %d", self.config.name, version)
        return {
            "engine": self.config.name,
            "version": version,
            "bytes": session.nbytes,
            "verified": bool(checksums),
        }

    async def _verify(self, expected: dict[str, str]) -> None:
        per_worker = await self.collective_rpc("weight_checksums", args=(list(expected),))
        raise_checksum_mismatch(f"engine {self.config.name}", expected, per_worker)

    async def abort_weight_sync(self, reason: str = "aborted by the caller") -> dict:
        """End the open sync without committing: restore the backup or mark the
        engine stale, then resume. Idempotent (no session: nothing to do)."""
        session = self._weight_session
        if session is None:
            return {
                "engine": self.config.name,
                "aborted": False,
                "stale": self.stale,
                "version": self.weight_version,
            }
        return await self._abort(session, reason)

    async def _expire(self, session: SyncSession) -> None:
        if self._weight_session is session:
            await self._abort(session, "the trainer went silent (idle deadline passed)")

    async def _abort(self, session: SyncSession, reason: str, locked: bool = False) -> dict:
        if self._weight_session is not session:  # already closed
            return {
                "engine": self.config.name,
                "aborted": False,
                "stale": self.stale,
                "version": self.weight_version,
            }
        self._weight_session = None
        session.stop_watchdog()
        was_stale = self.stale
        # Stale until we know better: a receive still running may load more.
        self.stale = True
        restored = False
        try:
            if locked:
                restored = await self._end_after_failure(session)
            else:
                async with self._lock():  # waits for a receive in flight
                    restored = await self._end_after_failure(session)
        finally:
            if restored or not session.touched:
                self.stale = was_stale
            await self.resume_generation()
        logger.error(
            "engine %s: weight sync to version %d aborted (%s); serving version %d%s",
            self.config.name,
            session.version,
            reason,
            self.weight_version,
            " (restored)" if restored else (" - STALE, resync needed" if self.stale else ""),
        )
        return {
            "engine": self.config.name,
            "aborted": True,
            "restored": restored,
            "stale": self.stale,
            "version": self.weight_version,
        }

    async def _end_after_failure(self, session: SyncSession) -> bool:
        restore = session.touched and session.on_failure == "restore"
        try:
            results = await self.collective_rpc("end_weight_sync", args=(restore, True))
        except Exception:  # noqa: BLE001 - the engine stays stale; reported in the log
            logger.exception("engine %s: restoring weights failed", self.config.name)
            return False
        return restore and all(r["restored"] for r in results)

    # --- OpenRLHF's per-parameter methods -------------------------------------------------
    async def _implicit_session(self) -> SyncSession:
        if self._weight_session is None:
            await self.begin_weight_sync(self.weight_version + 1)
            self._weight_session.implicit = True
        return self._weight_session

    async def _finish_implicit(self, session: SyncSession, empty_cache: bool) -> None:
        # OpenRLHF passes empty_cache=True with the last parameter of a sync.
        if empty_cache and session.implicit and self._weight_session is session:
            await self.finish_weight_sync(session.version)

    async def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False):
        """OpenRLHF: the trainer broadcasts this one tensor from rank 0 right
        after calling. The first call of a sync pauses generation; the call with
        `empty_cache=True` commits version + 1."""
        session = await self._implicit_session()
        await self._in_session(
            "update_weight",
            str(name),
            dtype_name(dtype),
            [int(d) for d in shape],
            bool(empty_cache),
            session=session,
        )
        await self._finish_implicit(session, empty_cache)

    async def update_weight_cuda_ipc(
        self, name: str, dtype: Any, shape: Any, ipc_handles: Any, empty_cache: bool = False
    ):
        """OpenRLHF's colocated path: `ipc_handles` maps GPU UUID to the
        tensor's `reduce_tensor` result (or its args)."""
        session = await self._implicit_session()
        blob = ipc_handles if isinstance(ipc_handles, bytes) else cuda_ipc.dumps(ipc_handles)
        await self._in_session(
            "update_weight_cuda_ipc",
            str(name),
            dtype_name(dtype),
            [int(d) for d in shape],
            blob,
            bool(empty_cache),
            session=session,
        )
        await self._finish_implicit(session, empty_cache)

    # --- one-call checkpoint sync ------------------------------------------------------------
    async def load_checkpoint(
        self,
        path: str,
        version: int | None = None,
        *,
        on_failure: str = "restore",
        verify: bool = True,
    ) -> dict:
        """Begin, load `path`, finish - on this engine alone (for a driver
        syncing several engines at once, see `weight_sync.checkpoint_sync`)."""
        from engines.weight_sync import checkpoint

        manifest = checkpoint.read_manifest(path)
        if version is None:
            version = checkpoint.read_version(path) or self.weight_version + 1
        await self.begin_weight_sync(
            version, manifest.model_dump(mode="json"), on_failure=on_failure, allow_partial=True
        )
        await self.load_weights_from_path(path, verify=verify)
        return await self.finish_weight_sync(version)
