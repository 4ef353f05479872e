"""The engine actor's sync session (`WeightSync`) on a fake engine: the real
session and worker router over a small torch module, with the checkpoint
transport (no process group needed). Real engines are in test_sync_into_engines.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from fake_engine import FakeEngine, FakeWorker, ProbedEngine, assert_state, model, run, state

from engines.errors import EngineStaleError
from engines.weight_sync.errors import (
    ChecksumMismatchError,
    ManifestMismatchError,
    ProbeMismatchError,
    WeightSyncError,
    WeightTransferError,
    WeightVersionError,
)
from engines.weight_sync.formats.buckets import plan_buckets
from engines.weight_sync.formats.checksum import checksums
from engines.weight_sync.formats.manifest import Manifest
from engines.weight_sync.probe import ProbeReference
from engines.weight_sync.transports import checkpoint


def test_a_full_sync_serves_the_new_version(engine, new_weights):
    path, expected = new_weights

    async def sync():
        manifest = checkpoint.read_manifest(path).model_dump(mode="json")
        await engine.begin_weight_sync(1, manifest)
        assert engine.paused
        await engine.load_weights_from_path(path)
        return await engine.finish_weight_sync(1, checksums(expected.items()))

    report = run(sync())
    assert report.verified and report.version == 1
    assert_state(engine.worker.model, expected)
    assert (engine.weight_version, engine.stale, engine.paused, engine.prefix_resets) == (
        1,
        False,
        False,
        1,
    )


def test_bad_version_or_manifest_changes_nothing(engine, new_weights):
    path, _ = new_weights
    before = state(engine.worker.model)
    engine.weight_version = 3
    with pytest.raises(WeightVersionError, match="serves version 3; a sync must not go back to 2"):
        run(engine.begin_weight_sync(2))
    engine.weight_version = 0
    wrong = Manifest.of([("weight", torch.zeros(4, 3)), ("bias", torch.zeros(3))])
    with pytest.raises(ManifestMismatchError, match=r"'weight': shape \[4, 3\] from the trainer"):
        run(engine.begin_weight_sync(1, wrong.model_dump(mode="json")))
    with pytest.raises(WeightSyncError, match="no weight sync open"):
        run(engine.load_weights_from_path(path))
    assert_state(engine.worker.model, before)
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)
    assert engine.weights.open is None


def partial_checkpoint(tmp_path, new_weights) -> str:
    """Loading stops part-way: the first tensor loads, the second has no home."""
    _, expected = new_weights
    tensors = [("bias", expected["bias"]), ("zzz.not_in_model", torch.zeros(2))]
    return str(checkpoint.save(tensors, tmp_path / "bad", version=1))


def test_failure_part_way_restores_the_old_weights(engine, new_weights, tmp_path):
    before = state(engine.worker.model)
    bad = partial_checkpoint(tmp_path, new_weights)

    async def sync():
        await engine.begin_weight_sync(1, None, on_failure="restore")
        await engine.load_weights_from_path(bad)

    with pytest.raises(WeightSyncError, match="zzz.not_in_model"):
        run(sync())
    assert_state(engine.worker.model, before)
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)
    assert engine.weights.open is None


def test_failure_part_way_without_backup_marks_the_engine_stale(engine, new_weights, tmp_path):
    bad = partial_checkpoint(tmp_path, new_weights)

    async def sync():
        await engine.begin_weight_sync(1, None, on_failure="stale")
        await engine.load_weights_from_path(bad)

    with pytest.raises(WeightSyncError):
        run(sync())
    # Resumed, so requests get the engine's stale error instead of waiting.
    assert (engine.weight_version, engine.stale, engine.paused) == (0, True, False)


def test_checksum_mismatch_aborts(engine, new_weights):
    path, expected = new_weights
    before = state(engine.worker.model)
    wrong = checksums(expected.items())
    wrong["bias"] = "0-0-0"

    async def sync():
        await engine.begin_weight_sync(1, None, on_failure="restore")
        await engine.load_weights_from_path(path)
        await engine.finish_weight_sync(1, wrong)

    with pytest.raises(ChecksumMismatchError, match="'bias'"):
        run(sync())
    assert_state(engine.worker.model, before)
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)


def test_receive_without_a_group_is_a_transfer_error(engine, new_weights):
    _, expected = new_weights
    plan = plan_buckets(Manifest.of(expected.items()), 1 << 20).model_dump(mode="json")

    async def sync():
        await engine.begin_weight_sync(1, None, on_failure="restore")
        with pytest.raises(WeightSyncError, match="invalid BucketPlan"):
            await engine.receive_weight_buckets({"buckets": []})
        assert engine.paused  # bad input: refused before anything was touched
        await engine.receive_weight_buckets(plan)

    with pytest.raises(WeightTransferError, match="init_process_group"):
        run(sync())
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_silent_trainer_is_aborted_by_the_watchdog(engine):
    async def sync():
        await engine.begin_weight_sync(1, None, idle_timeout_s=0.2)
        assert engine.paused
        await until(lambda: engine.weights.open is None)

    run(sync())
    assert engine.weights.open is None
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)


class BlockingWorker(FakeWorker):
    """Holds its method `blocks` until released: an abort arrives while the
    receive (or the restore after it) is in flight."""

    def __init__(self, model, blocks: str):
        super().__init__(model)
        self.blocks = blocks
        self.entered, self.release = threading.Event(), threading.Event()

    def _hold(self, method: str) -> None:
        if method == self.blocks:
            self.entered.set()
            assert self.release.wait(10)

    def load_weights_from_path(self, path: str, verify: bool = True) -> dict:
        self._hold("load_weights_from_path")
        return super().load_weights_from_path(path, verify)

    def end_weight_sync(self, restore: bool, failed: bool = False) -> dict:
        self._hold("end_weight_sync")
        return super().end_weight_sync(restore, failed)


@pytest.mark.parametrize("on_failure", ["stale", "restore"])
def test_abort_during_a_receive_waits_for_it(new_weights, on_failure):
    path, _ = new_weights
    engine = FakeEngine(model(0))
    worker = engine.worker = BlockingWorker(engine.worker.model, "load_weights_from_path")
    before = state(worker.model)

    async def sync():
        await engine.begin_weight_sync(1, None, on_failure=on_failure)
        receive = asyncio.create_task(engine.load_weights_from_path(path))
        assert await asyncio.to_thread(worker.entered.wait, 10)  # inside its load
        abort = asyncio.create_task(engine.abort_weight_sync("trainer gave up"))
        await until(lambda: engine.weights.open is None)  # the abort has begun
        assert not abort.done()  # and waits for the receive
        worker.release.set()
        aborted = await abort
        await receive
        return aborted

    aborted = run(sync())
    # The abort waited for the load to finish, then judged the weights.
    if on_failure == "restore":
        assert aborted.restored and not engine.stale
        assert_state(engine.worker.model, before)
    else:
        assert not aborted.restored and engine.stale
    assert (engine.weight_version, engine.paused) == (0, False)


def test_the_trainers_abort_waits_for_the_engines_own(new_weights, tmp_path):
    """A receive that fails aborts its sync itself (a broadcast whose peer
    died); the trainer's abort then finds no sync open, and must still
    answer with the engine as the restore leaves it, not as it stands
    part-way (marked stale until the backup is back)."""
    engine = FakeEngine(model(0))
    worker = engine.worker = BlockingWorker(engine.worker.model, "end_weight_sync")
    before = state(worker.model)
    bad = partial_checkpoint(tmp_path, new_weights)

    async def sync():
        await engine.begin_weight_sync(1, None, on_failure="restore")
        receive = asyncio.create_task(engine.load_weights_from_path(bad))
        assert await asyncio.to_thread(worker.entered.wait, 10)  # restoring
        abort = asyncio.create_task(engine.abort_weight_sync("a peer died"))
        for _ in range(20):  # every chance to answer early, without a clock
            await asyncio.sleep(0)
        assert not abort.done()
        worker.release.set()
        with pytest.raises(WeightSyncError, match="zzz.not_in_model"):
            await receive
        return await abort

    aborted = run(sync())
    assert not aborted.stale and aborted.version == 0
    assert_state(engine.worker.model, before)
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)


def test_begin_and_receive_with_commit_serves_the_new_version_in_one_call(engine, new_weights):
    path, expected = new_weights
    manifest = checkpoint.read_manifest(path).model_dump(mode="json")
    answer = run(
        engine.begin_and_receive(1, manifest, "load_weights_from_path", [path, False], commit=True)
    )
    assert answer.committed and answer.received.bytes == sum(
        t.numel() * t.element_size() for t in expected.values()
    )
    assert_state(engine.worker.model, expected)
    assert (engine.weight_version, engine.stale, engine.paused) == (1, False, False)
    assert engine.weights.open is None


def test_begin_and_receive_without_commit_leaves_the_sync_open(engine, new_weights):
    path, expected = new_weights

    async def sync():
        answer = await engine.begin_and_receive(1, None, "load_weights_from_path", [path])
        # Loaded but not served: the trainer checks, then finishes.
        assert not answer.committed and engine.paused and engine.weight_version == 0
        return await engine.finish_weight_sync(1, checksums(expected.items()))

    assert run(sync()).verified
    assert (engine.weight_version, engine.stale, engine.paused) == (1, False, False)


@pytest.mark.parametrize("commit", [True, False])
def test_begin_and_receive_failing_part_way_restores_and_closes_the_sync(
    engine, new_weights, tmp_path, commit
):
    before = state(engine.worker.model)
    bad = partial_checkpoint(tmp_path, new_weights)
    with pytest.raises(WeightSyncError, match="zzz.not_in_model"):
        run(
            engine.begin_and_receive(
                1, None, "load_weights_from_path", [bad], commit=commit, on_failure="restore"
            )
        )
    assert_state(engine.worker.model, before)
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)
    assert engine.weights.open is None


def test_begin_and_receive_refusing_its_arguments_leaves_nothing_open(engine):
    # Named receive not allowed: refused before the sync opens.
    with pytest.raises(WeightSyncError, match="'receive_weight_buckets'"):
        run(engine.begin_and_receive(1, None, "receive_weight_buckets", [{}]))
    # The receive refuses its arguments after begin (handles that are not
    # bytes): the sync it opened is closed again, the engine resumed.
    with pytest.raises(WeightSyncError, match="must be bytes"):
        run(engine.begin_and_receive(1, None, "receive_shared_weights", ["m", 123, False]))
    assert (engine.weight_version, engine.stale, engine.paused) == (0, False, False)
    assert engine.weights.open is None


# --- the probe rides with the first work after the commit ----------------------------------
REFERENCE = ProbeReference((1, 2, 3, 4), (-1.0, -2.0, -3.0), tolerance=0.1)


def probed_sync(path: str, logprobs: list[float]) -> tuple[ProbedEngine, list]:
    """A sync with the probe, which answers `logprobs` only once two calls
    have computed on the new weights: one that waited at the door through
    the sync, one let in while the probe ran. Neither call nor the commit
    may have returned by then. Returns the engine and the outcomes of the
    commit and the two calls (values or errors)."""
    engine = ProbedEngine(model(0), logprobs)

    async def scenario():
        done = asyncio.Event()
        await engine.begin_weight_sync(1)
        queued = asyncio.create_task(engine.generate("queued", done))
        await engine.load_weights_from_path(path)
        commit = asyncio.create_task(engine.finish_weight_sync(1, probe=REFERENCE))
        await engine.probe_started.wait()
        assert engine.weight_version == 1 and not engine.door.closed  # committed, door open
        during = asyncio.create_task(engine.generate("during", done))
        done.set()
        async with asyncio.timeout(10):
            while len([e for e in engine.events if e.endswith("computed")]) < 2:
                await asyncio.sleep(0)
        assert not commit.done() and not queued.done() and not during.done()
        engine.probe_go.set()
        return await asyncio.gather(commit, queued, during, return_exceptions=True)

    return engine, run(scenario())


def test_outputs_computed_beside_the_probe_wait_for_its_verdict(new_weights):
    path, expected = new_weights
    engine, (committed, *answers) = probed_sync(path, [-1.0, -2.0, -3.0])
    assert committed.probe.status == "passed" and answers == ["queued", "during"]
    assert_state(engine.worker.model, expected)
    assert (engine.weight_version, engine.stale) == (1, False)


def test_a_probe_mismatch_fails_the_held_calls_and_serves_none(new_weights):
    path, _ = new_weights
    engine, (committed, *answers) = probed_sync(path, [-1.0, -7.5, -3.0])
    assert isinstance(committed, ProbeMismatchError)
    assert "engine -7.5000, trainer -2.0000" in str(committed)
    assert all(isinstance(a, EngineStaleError) for a in answers), answers
    assert "its probe failed" in str(answers[0]) and "engine -7.5000" in str(answers[0])
    # Stale, at the version it served before: a failed sync never moves it on.
    assert (engine.weight_version, engine.stale) == (0, True)


def test_a_resume_failing_after_the_commit_fails_the_held_calls_instead_of_hanging(new_weights):
    """Outputs are held before the door opens; a resume that raises (vLLM's
    core dead at the thaw, a cancelled finish) starts no probe to settle
    them: the calls inside must fail, not wait on a verdict for ever."""
    path, _ = new_weights
    engine = ProbedEngine(model(0), [-1.0, -2.0, -3.0])

    async def thaw_fails() -> None:
        raise RuntimeError("engine core died at the thaw")

    engine.resume_generation = thaw_fails

    async def scenario():
        done = asyncio.Event()
        inside = asyncio.create_task(engine.generate("inside", done))
        async with asyncio.timeout(10):
            while "inside in" not in engine.events:
                await asyncio.sleep(0)
        await engine.begin_weight_sync(1)
        await engine.load_weights_from_path(path)
        with pytest.raises(RuntimeError, match="died at the thaw"):
            await engine.finish_weight_sync(1, probe=REFERENCE)
        done.set()
        async with asyncio.timeout(10):
            return await asyncio.gather(inside, return_exceptions=True)

    (answer,) = run(scenario())
    assert isinstance(answer, EngineStaleError), answer
    assert "its probe did not run" in str(answer) and "died at the thaw" in str(answer)
    assert (engine.weight_version, engine.stale) == (0, True)
