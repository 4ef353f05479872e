"""Weight-update methods that run where the model lives: inside each vLLM GPU
worker (vLLM's `worker_extension_cls` points here) and inside the CPU
backend's worker. Engines call them through `RolloutEngine.collective_rpc`.

Contract: the host class provides `self.model_runner.get_model()` (vLLM) or
overrides `_model()`; `self.device`; `self.rank` (tensor-parallel rank).

Every transport's receiving side is here. Arguments and results are plain
data (str, int, float, bool, list, dict, bytes): vLLM's collective_rpc crosses
a msgpack hop that refuses torch types. Method names avoid those vLLM 0.26
reserves on its Worker (`update_weights`, `start_weight_update`, ...); the
OpenRLHF names (`init_process_group`, `update_weight`,
`update_weight_cuda_ipc`) are free there.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from engines.weight_sync import checkpoint, cuda_ipc
from engines.weight_sync.broadcast import WeightGroup
from engines.weight_sync.buckets import BucketPlan, bucket_key, unpack_bucket
from engines.weight_sync.checksum import device_sums, finish_checksums, nbytes_of
from engines.weight_sync.config import GroupInfo
from engines.weight_sync.errors import WeightSyncError, WeightTransferError
from engines.weight_sync.manifest import Manifest, ParamSpec, dtype_name, mismatches, torch_dtype

logger = logging.getLogger(__name__)


class WeightSyncWorkerExtension:
    # Instance state, created on first use (vLLM mixes this class into its
    # Worker, whose __init__ we do not control).
    _weight_group: WeightGroup | None = None
    _weight_backup: dict[str, Any] | None = None
    # name -> (bytes, checksum sums on the device) of what the last sync received.
    _wire_sums: dict[str, tuple[int, Any]] | None = None
    # (mapping id, [(name, tensor)]): a colocated trainer's tensors, kept
    # mapped between CUDA IPC syncs while the trainer's layout is unchanged.
    _shared_weights: tuple[str, list[tuple[str, Any]]] | None = None
    _copy_event: Any = None  # recorded after the copies from kept shared weights
    _expected: Manifest | None = None
    _copy_plan: Any = None  # CopyPlan, made on the first load
    _bucket_plan: tuple[dict, BucketPlan] | None = None  # (as sent, validated)

    def _model(self):
        # get_model() unwraps the CUDA-graph wrapper vLLM may put around the
        # model (v1/worker/gpu_model_runner.py, vLLM 0.26).
        return self.model_runner.get_model()

    # --- what this worker expects -------------------------------------------------
    def _is_vllm_model(self) -> bool:
        # vLLM models take HF-named weights through `load_weights` (fusing
        # qkv / gate_up and sharding for TP); transformers models have none.
        return hasattr(self._model(), "load_weights")

    def _expected_manifest(self) -> Manifest:
        if self._expected is None:
            if self._is_vllm_model():
                self._expected = self._checkpoint_manifest()
            else:
                self._expected = Manifest.of(self._model().named_parameters())
        return self._expected

    def _checkpoint_manifest(self) -> Manifest:
        """vLLM's parameters are fused and sharded, so the HF layout a trainer
        sends is read from the checkpoint the engine loaded; floating-point
        weights arrive in the serving dtype."""
        config = self.model_config
        path = config.model
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(
                path,
                revision=config.revision,
                local_files_only=True,
                allow_patterns=["*.safetensors", "*.json"],
            )
        serving = dtype_name(config.dtype)
        params = [
            p.model_copy(update={"dtype": serving}) if torch_dtype(p.dtype).is_floating_point else p
            for p in checkpoint.read_manifest(path).params
        ]
        return Manifest(params=tuple(params))

    def weight_manifest(self) -> dict:
        """The layout this worker accepts (HF names), as plain data."""
        return self._expected_manifest().model_dump(mode="json")

    def weight_manifest_problems(self, manifest: dict, allow_partial: bool = False) -> list[str]:
        """Differences between the trainer's manifest and this worker's, one
        line each (plain data: exception types do not survive vLLM's RPC)."""
        got = Manifest.model_validate(manifest)
        # A checkpoint may hold weights vLLM does not load (tied lm_head, rotary
        # buffers), so on vLLM only the names the trainer sends are checked.
        return mismatches(
            self._expected_manifest(), got, allow_partial=allow_partial or self._is_vllm_model()
        )

    def _problems_of(self, spec: ParamSpec) -> list[str]:
        return self.weight_manifest_problems(
            Manifest(params=(spec,)).model_dump(mode="json"), allow_partial=True
        )

    # --- loading --------------------------------------------------------------------
    def _load_weights(self, weights: list[tuple[str, Any]], repeat: bool = False) -> None:
        # Loaded once through the model's loader, then replayed as copies
        # (`repeat`: the same tensors come again, see CopyPlan.load).
        if self._copy_plan is None:
            from engines.weight_sync.copy_plan import CopyPlan

            self._copy_plan = CopyPlan(self._model(), self._model_loader())
        self._copy_plan.load(weights, repeat=repeat)

    def _model_loader(self):
        model = self._model()
        if self._is_vllm_model():
            return lambda weights: model.load_weights(weights=weights)
        params = dict(model.named_parameters())

        def copy_by_name(weights: list[tuple[str, Any]]) -> None:
            for name, tensor in weights:
                if name not in params:
                    raise WeightSyncError(f"the model has no parameter {name!r}")
                params[name].copy_(tensor)

        return copy_by_name

    def copy_plan_status(self) -> dict:
        """Whether loads replay recorded copies (and how many), or why not."""
        plan = self._copy_plan
        if plan is None:
            return {"copies": 0, "refused": None, "graph": False, "graph_error": None}
        return {
            "copies": plan.size,
            "refused": plan.refused,
            "graph": plan.captured,
            "graph_error": plan.graph_error,
        }

    def _record_wire(self, weights: list[tuple[str, Any]]) -> None:
        # Sums stay on the device (no host round trip per tensor); rendered
        # when the trainer asks for them.
        if self._wire_sums is None:
            self._wire_sums = {}
        for name, tensor in weights:
            self._wire_sums[name] = (nbytes_of(tensor), device_sums(tensor))

    def _empty_cache(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # --- the sync around a transfer ---------------------------------------------------
    def prepare_weight_sync(self, backup: bool) -> dict:
        """Before the first byte: with `backup`, keep a host copy of the
        weights to restore on failure; say which weight group this worker is in."""
        self._weight_backup = None
        started = time.monotonic()
        if backup:
            self._weight_backup = {
                name: t.detach().to("cpu", copy=True)
                for name, t in self._model().state_dict(keep_vars=True).items()
            }
        nbytes = sum(nbytes_of(t) for t in (self._weight_backup or {}).values())
        return {
            "backup_bytes": nbytes,
            "seconds": time.monotonic() - started,
            "group_id": self.weight_group_id(),
        }

    def end_weight_sync(self, restore: bool, failed: bool = False) -> dict:
        """After the sync: with `restore`, put the backup back (a failed sync);
        always drop it and the sync's checksums. After a failure, shared
        trainer tensors are dropped too (the trainer shares them afresh).
        Returns whether the old weights were restored."""
        self._wire_sums = None
        if failed:
            self._shared_weights = None
        restored = False
        if restore and self._weight_backup is not None:
            import torch

            state = self._model().state_dict(keep_vars=True)
            with torch.no_grad():
                for name, saved in self._weight_backup.items():
                    state[name].copy_(saved)
            restored = True
        self._weight_backup = None
        if failed:
            self._empty_cache()  # what a receive left allocated when it failed
        return {"restored": restored}

    def weight_checksums(self, names: list[str]) -> dict[str, str | None]:
        """Checksums of the live weights by HF name where the model keeps that
        name (transformers models); of the bytes received in the last sync
        otherwise: per tensor, or per bucket (`bucket-<i>`) for a bucketed
        broadcast (vLLM fuses and shards, so its live tensors have other
        names and shapes). None for a name neither knows. For inspection and
        `verify_weight_sync`; the sync's own receives return theirs."""
        live = {} if self._is_vllm_model() else dict(self._model().named_parameters())
        pending = {n: (nbytes_of(live[n]), device_sums(live[n])) for n in names if n in live}
        wire = self._wire_sums or {}
        pending.update({n: wire[n] for n in names if n not in live and n in wire})
        known = finish_checksums(pending)
        return {name: known.get(name) for name in names}

    def read_weights(self, names: list[str]) -> dict[str, Any]:
        """Copies of live weights by name (HF names on transformers models,
        vLLM's own names on vLLM), for inspection and tests."""
        state = dict(self._model().named_parameters())
        missing = [n for n in names if n not in state]
        if missing:
            raise WeightSyncError(f"the model has no parameters {missing[:5]}")
        return {n: state[n].detach().to("cpu", copy=True) for n in names}

    # --- collective broadcast -------------------------------------------------------
    def init_process_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        timeout_s: float = 60.0,
    ) -> int:
        """Join the trainer's group as rank `rank_offset + self.rank` (OpenRLHF's
        WorkerWrap.init_process_group); returns that rank."""
        self.destroy_weight_group()
        info = GroupInfo(
            master_address, int(master_port), int(world_size), group_name, backend, float(timeout_s)
        )
        rank = int(rank_offset) + int(self.rank)
        self._weight_group = WeightGroup(info, rank, device=self.device)
        return rank

    def destroy_weight_group(self) -> None:
        if self._weight_group is not None:
            self._weight_group.destroy()
            self._weight_group = None

    def has_weight_group(self) -> bool:
        return self._weight_group is not None and self._weight_group.alive

    def weight_group_id(self) -> str | None:
        return self._weight_group.group_id if self.has_weight_group() else None

    def _group(self) -> WeightGroup:
        if self._weight_group is None or not self._weight_group.alive:
            raise WeightTransferError(
                "no weight group on this worker: call init_process_group first (a failed "
                "sync tears the group down)"
            )
        return self._weight_group

    def update_weight(
        self, name: str, dtype: str, shape: list[int], empty_cache: bool = False
    ) -> dict:
        """OpenRLHF's per-parameter path: receive one tensor broadcast from rank 0
        and load it. The tensor is received before it is checked, so a bad
        name does not leave the trainer hanging in the collective; a bad one
        is not loaded and comes back in `problems`."""
        import torch

        spec = ParamSpec(name=name, dtype=dtype, shape=tuple(shape))
        weight = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
        self._group().broadcast(weight, src=0)
        problems = self._problems_of(spec)
        if not problems:
            self._record_wire([(name, weight)])
            self._load_weights([(name, weight)])
        del weight
        if empty_cache:
            self._empty_cache()
        return {"bytes": spec.nbytes, "problems": problems}

    def receive_weight_buckets(self, plan: dict, verify: bool = True) -> dict:
        """Our bucketed path: every bucket of the plan arrives as one broadcast
        of a flat buffer, is unpacked into views and loaded. Two buffers take
        turns, so bucket k+1 is on the wire while bucket k is loaded."""
        if self._bucket_plan is None or self._bucket_plan[0] != plan:
            # Validated once per layout: most syncs send the plan of the last.
            self._bucket_plan = (plan, BucketPlan.model_validate(plan))
        plan_ = self._bucket_plan[1]
        group = self._group()  # fail before anything is allocated
        result = self._receive_buckets(plan_, group, verify)
        # The receive buffers (two buckets) go back to the GPU.
        self._empty_cache()
        return self._with_checksums(result, verify)

    def _with_checksums(self, result: dict, verify: bool) -> dict:
        """`result` with the checksums of what this sync received (one host
        copy), for the trainer to compare: no separate verify call."""
        if verify:
            result["checksums"] = finish_checksums(self._wire_sums or {})
        return result

    def _receive_buckets(self, plan_: BucketPlan, group: WeightGroup, verify: bool) -> dict:
        import torch

        started = time.monotonic()
        size = max(b.nbytes for b in plan_.buckets)
        buffers = [
            torch.empty(size, dtype=torch.uint8, device=self.device)
            for _ in range(min(2, len(plan_.buckets)))
        ]
        in_flight = []
        times = {"wait_s": 0.0, "load_s": 0.0}
        for index, bucket in enumerate(plan_.buckets):
            flat = buffers[index % 2][: bucket.nbytes]
            # Starts after the loads already queued on this stream, so the
            # buffer's previous bucket is consumed before it is overwritten.
            in_flight.append((index, bucket, flat, group.start_broadcast(flat, src=0)))
            if len(in_flight) == 2:
                self._load_received(group, *in_flight.pop(0), verify=verify, times=times)
        for received in in_flight:
            self._load_received(group, *received, verify=verify, times=times)
        mark = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        times["load_s"] += time.monotonic() - mark
        return {
            "bytes": plan_.nbytes,
            "buckets": len(plan_.buckets),
            "seconds": time.monotonic() - started,
            **times,
        }

    def _load_received(
        self, group: WeightGroup, index: int, bucket, flat, pending, verify: bool, times: dict
    ) -> None:
        # Waiting here (with the group's deadline) keeps load_weights from
        # queueing behind a broadcast that may never finish.
        mark = time.monotonic()
        group.wait(pending)
        waited = time.monotonic()
        if verify:
            # One checksum per bucket, as the trainer packed it: a few calls
            # per sync instead of several per tensor on this critical path.
            self._record_wire([(bucket_key(index), flat)])
        self._load_weights(unpack_bucket(bucket, flat))
        # Host time: what the wire waits for while this worker queues work.
        times["wait_s"] += waited - mark
        times["load_s"] += time.monotonic() - waited

    # --- CUDA IPC (colocated) -------------------------------------------------------
    def update_weight_cuda_ipc(
        self, name: str, dtype: str, shape: list[int], ipc_handles: Any, empty_cache: bool = False
    ) -> dict:
        """OpenRLHF's colocated path: the trainer's tensor, opened by IPC handle."""
        import torch

        spec = ParamSpec(name=name, dtype=dtype, shape=tuple(shape))
        problems = self._problems_of(spec)
        if problems:
            return {"bytes": 0, "problems": problems}
        handles = cuda_ipc.loads(ipc_handles) if isinstance(ipc_handles, bytes) else ipc_handles
        weight = self._open_announced(spec, handles)
        self._record_wire([(name, weight)])
        self._load_weights([(name, weight)])
        # The trainer frees or reuses its memory once we return.
        torch.cuda.synchronize(self.device)
        if empty_cache:
            self._empty_cache()
        return {"bytes": spec.nbytes, "problems": []}

    def receive_shared_weights(
        self, mapping: str, shared: bytes | None, keep: bool, signal: bool = False
    ) -> dict:
        """Load a colocated trainer's tensors straight from its memory: one
        copy, no buffer. `shared`: the pickled `{"params": [[name, dtype,
        shape], ...], "handles": [per-tensor handles]}` of `CudaIpcSender`, or
        None to reuse the tensors kept under `mapping` by the last sync.
        `signal` (with `keep`): answer once the copies are queued, with the
        handle of a CUDA event recorded after them (`copies_done`), for the
        trainer to wait on; otherwise answer once they are done."""
        import torch

        started = time.monotonic()
        if shared is None:
            if self._shared_weights is None or self._shared_weights[0] != mapping:
                raise WeightTransferError(
                    f"this worker does not hold the shared weights {mapping!r}; the trainer "
                    "must send their handles again"
                )
            weights = self._shared_weights[1]
        else:
            self._shared_weights = None  # the trainer may free the old tensors now
            weights, problems = self._open_shared(cuda_ipc.loads(shared))
            if problems:
                return {"bytes": 0, "problems": problems}
        opened = time.monotonic()
        self._load_weights(weights, repeat=keep)
        answer = {
            "bytes": sum(nbytes_of(t) for _, t in weights),
            "problems": [],
            "holds_sync_state": False,  # nothing for end_weight_sync to drop
            "open_s": opened - started,
        }
        if signal and keep:
            # Forward passes run on this thread's stream too, after the copies
            # queued here, so no request can read a half-copied weight. The
            # tensors stay mapped (`keep`) while the GPU still reads them.
            if self._copy_event is None:
                self._copy_event = cuda_ipc.copy_event()
            self._copy_event.record()
            answer["copies_done"] = bytes(self._copy_event.ipc_handle())
        else:
            # The trainer writes these tensors again (or frees them) once we return.
            torch.cuda.synchronize(self.device)
        self._shared_weights = (mapping, weights) if keep else None
        answer["load_s"] = time.monotonic() - opened
        return answer

    def _open_shared(self, shared: dict) -> tuple[list[tuple[str, Any]], list[str]]:
        specs = Manifest(
            params=tuple(ParamSpec(name=n, dtype=d, shape=s) for n, d, s in shared["params"])
        )
        problems = self.weight_manifest_problems(specs.model_dump(mode="json"), allow_partial=True)
        if problems:
            return [], problems
        pairs = zip(specs.params, shared["handles"], strict=True)
        return [(spec.name, self._open_announced(spec, handles)) for spec, handles in pairs], []

    def _open_announced(self, spec: ParamSpec, handles: dict) -> Any:
        """The trainer's tensor behind `handles`, which must be what `spec` announced."""
        tensor = cuda_ipc.open_shared(handles, self.device.index)
        if tuple(tensor.shape) != spec.shape or tensor.dtype != torch_dtype(spec.dtype):
            raise WeightTransferError(
                f"{spec.name!r}: the shared tensor is {tensor.dtype} {list(tensor.shape)}, "
                f"announced {spec.dtype} {list(spec.shape)}"
            )
        return tensor

    def release_shared_weights(self) -> None:
        self._shared_weights = None

    # --- checkpoint directory ---------------------------------------------------------
    def load_weights_from_path(self, path: str, verify: bool = True) -> dict:
        """Load every weight of a safetensors checkpoint (HF layout)."""
        started = time.monotonic()
        nbytes = 0
        for name, tensor in checkpoint.iter_tensors(path, device="cpu"):
            weight = tensor.to(self.device)
            if verify:
                self._record_wire([(name, weight)])
            self._load_weights([(name, weight)])
            nbytes += nbytes_of(tensor)
        self._empty_cache()
        return self._with_checksums(
            {"bytes": nbytes, "seconds": time.monotonic() - started}, verify
        )
