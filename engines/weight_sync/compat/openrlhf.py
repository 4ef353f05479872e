"""Transport: OpenRLHF's per-parameter calls, so an OpenRLHF trainer drives
our engines unchanged (its `openrlhf/trainer/ray/vllm_engine.py` call sites):
`init_process_group(...)` (the weight group, `group.py`), then per tensor
`update_weight(name, dtype, shape, empty_cache)` followed by the trainer's
broadcast from rank 0, or `update_weight_cuda_ipc(name, dtype, shape,
ipc_handles, empty_cache)` when colocated.

The trainer side is OpenRLHF's own code (tests/engines/weight_sync/openrlhf_trainer.py
mirrors it). The first call of a sync opens a session implicitly (pause).
It commits version + 1 on the call with `empty_cache=True` (OpenRLHF sends it
with the last parameter) or, for trainers that never send one (older
OpenRLHF, hand-written loops), on the call that completes the engine's
parameter set: every name of the engine's manifest has arrived, which is the
state `empty_cache=True` would commit. A trainer that sends only part of the
parameters and no `empty_cache=True` leaves the sync open until the idle
deadline aborts it.
"""

from __future__ import annotations

from typing import Any

from engines.weight_sync.formats import ipc_handles as ipc
from engines.weight_sync.formats import moe
from engines.weight_sync.formats.manifest import Manifest, ParamSpec, dtype_name
from engines.weight_sync.open_sync import OpenSync
from engines.weight_sync.protocol import Transport, WorkerAnswer
from engines.weight_sync.session import WeightSync
from engines.weight_sync.worker import WorkerWeights


# --- engine actor --------------------------------------------------------------------------
async def _implicit_session(sync: WeightSync) -> OpenSync:
    if sync.open is None:
        await sync.begin_weight_sync(sync.host.weight_version + 1)
        sync.open.implicit = True
    return sync.open


async def _engine_names(sync: WeightSync) -> frozenset[str]:
    names = sync.held.get("openrlhf")
    if names is None:
        manifest = Manifest.model_validate(await sync.weight_manifest())
        names = sync.held["openrlhf"] = frozenset(manifest.names)
    return names


async def _after(
    sync: WeightSync, session: OpenSync, spec: tuple[str, str, list[int]], empty_cache: bool
) -> None:
    if not session.implicit or sync.open is not session:
        return
    names = await _engine_names(sync)
    # A fused MoE tensor completes the per-expert names a vLLM engine holds.
    (name, dtype, shape) = spec
    arrived = Manifest(params=(ParamSpec(name=name, dtype=dtype, shape=tuple(shape)),))
    session.received.update(moe.in_engine_layout(arrived, names).names)
    if empty_cache or session.received >= names:
        await sync.finish_weight_sync(session.version)


def _spec(name: str, dtype: Any, shape: Any) -> tuple[str, str, list[int]]:
    return str(name), dtype_name(dtype), [int(d) for d in shape]


async def update_weight(
    sync: WeightSync, name: str, dtype: Any, shape: Any, empty_cache: bool = False
) -> None:
    """OpenRLHF: the trainer broadcasts this one tensor from rank 0 right
    after calling. The first call of a sync pauses generation; the call with
    `empty_cache=True`, or the one completing the parameter set, commits
    version + 1."""
    session = await _implicit_session(sync)
    spec = _spec(name, dtype, shape)
    await sync.receive("update_weight", *spec, bool(empty_cache), session=session)
    await _after(sync, session, spec, empty_cache)


async def update_weight_cuda_ipc(
    sync: WeightSync, name: str, dtype: Any, shape: Any, ipc_handles: Any, empty_cache: bool = False
) -> None:
    """OpenRLHF's colocated path: `ipc_handles` maps GPU UUID to the
    tensor's `reduce_tensor` result (or its args)."""
    session = await _implicit_session(sync)
    spec = _spec(name, dtype, shape)
    blob = ipc_handles if isinstance(ipc_handles, bytes) else ipc.dumps(ipc_handles)
    await sync.receive("update_weight_cuda_ipc", *spec, blob, bool(empty_cache), session=session)
    await _after(sync, session, spec, empty_cache)


# --- worker --------------------------------------------------------------------------------
def worker_update_weight(
    worker: WorkerWeights, name: str, dtype: str, shape: list[int], empty_cache: bool = False
) -> dict:
    """Receive one tensor broadcast from rank 0 and load it (a bad one is
    received, so the trainer is not left in the collective, but not loaded)."""
    spec = ParamSpec(name=name, dtype=dtype, shape=tuple(shape))
    weight, problems = worker.receive_one(spec)
    if not problems:
        worker.record_wire([(name, weight)])
        worker.load([(name, weight)])
    del weight
    if empty_cache:
        worker.empty_cache()
    return WorkerAnswer(bytes=spec.nbytes, problems=problems).plain()


def worker_update_weight_cuda_ipc(
    worker: WorkerWeights,
    name: str,
    dtype: str,
    shape: list[int],
    ipc_handles: bytes,
    empty_cache: bool = False,
) -> dict:
    """The trainer's tensor, opened by IPC handle, loaded."""
    import torch

    spec = ParamSpec(name=name, dtype=dtype, shape=tuple(shape))
    problems = worker.problems_of([spec])
    if problems:
        return WorkerAnswer(problems=problems).plain()
    weight = ipc.open_announced(worker, spec, ipc.loads(ipc_handles))
    worker.record_wire([(name, weight)])
    worker.load([(name, weight)])
    # The trainer frees or reuses its memory once we return.
    torch.cuda.synchronize(worker.device)
    if empty_cache:
        worker.empty_cache()
    return WorkerAnswer(bytes=spec.nbytes).plain()


TRANSPORT = Transport(
    "openrlhf",
    engine_methods={
        "update_weight": update_weight,
        "update_weight_cuda_ipc": update_weight_cuda_ipc,
    },
    worker_methods={
        "update_weight": worker_update_weight,
        "update_weight_cuda_ipc": worker_update_weight_cuda_ipc,
    },
)
