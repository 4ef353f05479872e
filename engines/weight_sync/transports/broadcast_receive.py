"""The engines' side of the bucketed broadcast (`broadcast.py`): the engine
actor takes the trainer's bucket plan, and each worker receives every
bucket into two buffers that take turns, loading one while the next is on
the wire.
"""

from __future__ import annotations

import time

from engines.weight_sync.formats.buckets import BucketPlan, bucket_key, unpack_bucket
from engines.weight_sync.group import WeightGroup
from engines.weight_sync.protocol import Received, WorkerAnswer
from engines.weight_sync.session import WeightSync, validated
from engines.weight_sync.worker import WorkerWeights


# --- engine actor --------------------------------------------------------------------------
async def receive_weight_buckets(sync: WeightSync, plan: dict, verify: bool = True) -> Received:
    """Receive a whole bucket plan over the weight group (the trainer
    broadcasts the buckets right after calling this)."""
    # Most syncs send the plan of the last one: a comparison, no validation.
    if sync.held.get("broadcast") != plan:
        validated(BucketPlan, plan, sync.name)
        sync.held["broadcast"] = plan
    # One call receives every bucket: the deadline grows with their number.
    timeout = sync.rpc_timeout() * max(1, len(plan["buckets"]))
    return await sync.receive("receive_weight_buckets", plan, bool(verify), timeout_s=timeout)


# --- worker --------------------------------------------------------------------------------
def worker_receive_buckets(worker: WorkerWeights, plan: dict, verify: bool = True) -> dict:
    """Every bucket of the plan arrives as one broadcast of a flat buffer, is
    unpacked into views and loaded. Two buffers take turns, so bucket k+1 is
    on the wire while bucket k is loaded."""
    held = worker.held.get("broadcast")
    if held is None or held[0] != plan:
        # Validated once per layout: most syncs send the plan of the last.
        held = worker.held["broadcast"] = (plan, BucketPlan.model_validate(plan))
    group = worker.live_group()  # fail before anything is allocated
    answer = _receive_buckets(worker, held[1], group, verify)
    # The receive buffers (two buckets) go back to the GPU.
    worker.empty_cache()
    return worker.answer(answer, verify)


def _receive_buckets(
    worker: WorkerWeights, plan: BucketPlan, group: WeightGroup, verify: bool
) -> WorkerAnswer:
    import torch

    # vLLM's layerwise reload keeps a layer's tensors until the layer is whole,
    # maybe past the next bucket: then each bucket gets a buffer of its own.
    reuse = worker.replays()
    size = max(b.nbytes for b in plan.buckets) if reuse else 0
    buffers = [torch.empty(size, dtype=torch.uint8, device=worker.device) for _ in plan.buckets[:2]]
    in_flight = []
    times = {"wait_s": 0.0, "load_s": 0.0}

    def load(index: int, bucket, flat, pending) -> None:
        # Waiting here (with the group's deadline) keeps load_weights from
        # queueing behind a broadcast that may never finish.
        mark = time.monotonic()
        group.wait(pending)
        waited = time.monotonic()
        if verify:
            # One checksum per bucket, as the trainer packed it: a few calls
            # per sync instead of several per tensor on this critical path.
            worker.record_wire([(bucket_key(index), flat)])
        worker.load(unpack_bucket(bucket, flat))
        # Host time: what the wire waits for while this worker queues work.
        times["wait_s"] += waited - mark
        times["load_s"] += time.monotonic() - waited

    for index, bucket in enumerate(plan.buckets):
        if not reuse:
            buffers[index % 2] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=worker.device)
        flat = buffers[index % 2][: bucket.nbytes]
        # Starts after the loads already queued on this stream, so the
        # buffer's previous bucket is consumed before it is overwritten.
        in_flight.append((index, bucket, flat, group.start_broadcast(flat, src=0)))
        if len(in_flight) == 2:
            load(*in_flight.pop(0))
    for received in in_flight:
        load(*received)
    mark = time.monotonic()
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    times["load_s"] += time.monotonic() - mark
    return WorkerAnswer(bytes=plan.nbytes, times=times)
