"""Interprocess CUDA events for copies out of a trainer's memory: the
engine worker queues its copies from the trainer's mapped tensors, records
an event after them (`record_copies`) and answers at once; the trainer waits
on that event (`CopyEvents`) before it writes that memory again. The
answer's way back (through vLLM's engine core and Ray) then overlaps the
copies instead of following them. The engine's own forward passes run on
the worker's stream after the copies, so no request reads a half-copied
weight. Used by the CUDA IPC transport (`transports/cuda_ipc.py`) and the
LoRA adapter's packed buffer (`lora/`).
"""

from __future__ import annotations

import time
from typing import Any

from engines.weight_sync.errors import WeightTransferError


def record_copies(held: dict[str, Any], key: str) -> bytes:
    """The handle of an interprocess event recorded on this thread's stream
    after the copies queued so far; the event is made once and kept in
    `held[key]` (a worker's state), so its handle stays the same."""
    import torch

    event = held.get(key)
    if event is None:
        event = held[key] = torch.cuda.Event(interprocess=True)
    event.record()
    return bytes(event.ipc_handle())


class CopyEvents:
    """The trainer's side: the workers' copy events, opened once each, waited on."""

    def __init__(self) -> None:
        self._opened: dict[bytes, Any] = {}

    def wait(self, handles: list[bytes], device: Any, timeout_s: float) -> None:
        """Return once every event has completed; WeightTransferError after `timeout_s`."""
        import torch

        deadline = time.monotonic() + timeout_s
        for handle in handles:
            event = self._opened.get(handle)
            if event is None:
                event = _cuda(torch.cuda.Event.from_ipc_handle, device, handle)
                self._opened[handle] = event
            # Polled: Event.synchronize() has no deadline, and a worker that
            # dies mid-copy must not hang the trainer. The poll lasts at most
            # the copies' few milliseconds.
            while not _cuda(event.query):
                if time.monotonic() > deadline:
                    raise WeightTransferError(
                        f"the engines' copies out of the trainer's memory did not "
                        f"finish within {timeout_s:g}s"
                    )
                time.sleep(0)

    def clear(self) -> None:
        self._opened.clear()


def _cuda(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except RuntimeError as exc:  # CUDA's own: a bad handle, a lost context
        raise WeightTransferError(f"waiting for an engine's copies failed: {exc}") from exc
