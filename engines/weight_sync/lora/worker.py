"""A worker's side of a LoRA adapter's sync: the adapter's tensors received
(`formats.adapter.received_tensors`), checked and loaded into the store of
the worker's backend (`AdapterStore`, made by its host's `new_adapter_store`).
"""

from __future__ import annotations

import time
from typing import Any

from engines.weight_sync.formats.adapter import (
    AdapterStore,
    LoraSpec,
    PackedAdapter,
    received_tensors,
)
from engines.weight_sync.formats.checksum import nbytes_of
from engines.weight_sync.formats.copy_events import record_copies
from engines.weight_sync.protocol import WorkerAnswer
from engines.weight_sync.worker import WorkerWeights


def adapter_store(worker: WorkerWeights) -> AdapterStore:
    """The worker's adapters, in its backend's store (vLLM's LoRA manager or
    peft: the host makes it), made on first use."""
    if worker.adapters is None:
        worker.adapters = worker.host.new_adapter_store()
    return worker.adapters


def worker_receive_lora(
    worker: WorkerWeights, spec: dict, via: str, payload: Any, version: int, remove: list[int]
) -> dict:
    """Receive the adapter of `version` `via` one of `VIAS`, then `worker_load`."""
    started = time.monotonic()
    tensors = received_tensors(worker, via, payload)
    return worker_load(worker, spec, tensors, version, remove, time.monotonic() - started)


def worker_load(
    worker: WorkerWeights,
    spec: dict,
    tensors: dict[str, Any] | PackedAdapter,
    version: int,
    remove: list[int],
    open_s: float = 0.0,
) -> dict:
    """Build the adapter of `version` from `tensors` (owned by this worker,
    or the trainer's mapped buffer, which the store copies: then the answer
    carries the copy's event, `copies_done`) and register it; remove the
    versions in `remove`. A bad adapter (a target module the model has not,
    too many adapters) changes nothing and is answered as problems.
    `times`: seconds, and `*_at` moments (monotonic, one clock for every
    process of the host) the trainer turns into offsets into its sync."""
    opened = time.monotonic()
    store = adapter_store(worker)
    checked = LoraSpec.of(spec)
    packed = isinstance(tensors, PackedAdapter)
    names = tensors.names() if packed else list(tensors)
    problems = store.problems(checked, names, version, remove)
    if problems:
        return WorkerAnswer(problems=problems, holds_sync_state=False).plain()
    checked_at = time.monotonic()
    store.load(version, checked, tensors, remove)
    answer = WorkerAnswer(
        bytes=tensors.nbytes if packed else sum(nbytes_of(t) for t in tensors.values()),
        holds_sync_state=False,
    )
    if packed and worker.device.type == "cuda":
        # The copy out of the trainer's buffer is queued: answer now with its
        # event, which the trainer waits on before it packs that buffer again.
        answer.copies_done = record_copies(worker.held, "lora_ipc_event")
    queued = time.monotonic()
    # load_s, in parts: the checks and the store's own (`AdapterStore.times`).
    answer.times = {"open_s": open_s, "load_s": queued - opened, "check_s": checked_at - opened}
    answer.times.update(store.times, worker_in_at=opened - open_s, queued_at=queued)
    return answer.plain()


def worker_release_buffer(worker: WorkerWeights) -> None:
    worker.held.pop("lora_ipc", None)


def worker_lora_adapters(worker: WorkerWeights) -> list[str]:
    return adapter_store(worker).loaded() if worker.adapters is not None else []
