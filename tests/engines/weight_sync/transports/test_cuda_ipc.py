"""The CPU-testable parts of the CUDA IPC transport (waiting for the engines' copies, the engine's
answer). The GPU paths run in tests/gpu/test_gpu_weight_sync.py."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, model, run

from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.formats.copy_events import CopyEvents
from engines.weight_sync.protocol import WorkerAnswer


class FakeCopyEvent:
    """An opened copy event: done after `pending` queries, or CUDA failing."""

    def __init__(self, pending: int = 0, fails: bool = False):
        self.pending, self.fails = pending, fails

    def query(self) -> bool:
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.pending -= 1
        return self.pending < 0


def copy_events(**opened: FakeCopyEvent) -> CopyEvents:
    events = CopyEvents()
    # Stands in for events opened by handle (that needs CUDA).
    events._opened.update({name.encode(): event for name, event in opened.items()})
    return events


def test_the_trainer_waits_for_every_engines_copies():
    slow, fast = FakeCopyEvent(pending=3), FakeCopyEvent()
    copy_events(slow=slow, fast=fast).wait([b"slow", b"fast"], None, timeout_s=5)
    assert slow.pending < 0 and fast.pending < 0


def test_waiting_for_copies_has_a_deadline_and_a_typed_error():
    events = copy_events(stuck=FakeCopyEvent(pending=10**9), lost=FakeCopyEvent(fails=True))
    with pytest.raises(WeightTransferError, match="did not finish within 0.05s"):
        events.wait([b"stuck"], None, timeout_s=0.05)
    with pytest.raises(WeightTransferError, match="copies failed: CUDA error"):
        events.wait([b"lost"], None, timeout_s=5)


class TwoWorkerCopiesEngine(FakeEngine):
    """Two workers (tensor-parallel ranks) answering a CUDA IPC receive the way
    the real ones do with `signal`: copies queued, each with its own event."""

    async def collective_rpc(self, method, args=(), kwargs=None, timeout_s=None):
        assert method == "receive_shared_weights"
        _mapping, _shared, keep, signal = args
        answers = [
            WorkerAnswer(bytes=8, holds_sync_state=False, times={"load_s": 0.001}) for _ in range(2)
        ]
        if keep and signal:
            for rank, answer in enumerate(answers):
                answer.copies_done = f"event-of-rank-{rank}".encode()
        return [answer.plain() for answer in answers]


@pytest.mark.parametrize(("keep", "signal"), [(True, True), (True, False), (False, True)])
def test_a_shared_receive_hands_the_trainer_every_workers_copy_event(keep, signal):
    engine = TwoWorkerCopiesEngine(model(0))
    answer = run(
        engine.begin_and_receive(
            1, None, "receive_shared_weights", ["m", None, keep, signal], commit=True
        )
    )
    # Rank 1's event matters as much as rank 0's: the trainer must wait on both.
    expected = (b"event-of-rank-0", b"event-of-rank-1") if keep and signal else None
    assert answer.received.copies_done == expected
    assert answer.committed and engine.weight_version == 1
    assert answer.times["load_s"] == 0.001
