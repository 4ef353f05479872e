"""The CPU-testable part of the CUDA IPC transport (the engine's answer with every worker's copy
event; waiting on them: formats/test_copy_events.py). The GPU paths run in
tests/gpu/test_gpu_weight_sync.py."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, model, run

from engines.weight_sync.protocol import WorkerAnswer


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
