"""Waiting for an engine's copies out of the trainer's memory
(engines/weight_sync/formats/copy_events.py), with events that stand in for
CUDA's. Recording them needs a GPU: tests/gpu/test_gpu_weight_sync.py and
test_gpu_lora.py."""

from __future__ import annotations

import pytest

from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.formats.copy_events import CopyEvents


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
