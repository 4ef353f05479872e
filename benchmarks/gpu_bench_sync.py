"""Weight-sync figures of benchmarks/gpu_bench.py (sections ipc, nccl): one
sync of the whole model through the trainer's `sync_weights`, against the raw
operation on the same bytes.

ipc:  trainer and engine on one GPU (CUDA IPC) vs. one on-device copy.
nccl: trainer on one GPU, engine on the other (bucketed NCCL broadcast) vs.
      one raw NCCL broadcast (vLLM's PyNcclCommunicator, as our group uses).

Each figure is the second of two syncs (the first pays one-time set-up);
`transfer` is the phase that moves bytes (the buckets, their control calls
and the engine's load_weights); `total` adds check, begin, verify, finish.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The GPU tests' trainer (the reference policy in bf16): one definition.
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

TIMEOUT_S = 300
ENGINE = dict(max_len=2048, gpu_memory_utilization=0.3, backend="vllm", enforce_eager=True)


class RawPeer:
    """One rank of a bare NCCL broadcast (no buckets, no control calls)."""

    def run(self, host: str, port: int, rank: int, nbytes: int, repeats: int) -> float:
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        device = torch.device("cuda", torch.cuda.current_device())
        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=2)
        comm = PyNcclCommunicator(group, device=device)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        comm.broadcast(buffer, src=0)  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            comm.broadcast(buffer, src=0)
        torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - start) / repeats
        comm.destroy()
        return seconds


def two_syncs(ray, policy, engines, **init: Any) -> dict:
    ray.get(policy.init_weight_sync.remote(engines, **init), timeout=TIMEOUT_S)
    report = None
    for seed in (1, 2):
        ray.get(policy.perturb.remote(0.01, seed), timeout=TIMEOUT_S)
        report = ray.get(policy.sync_weights.remote(), timeout=TIMEOUT_S)
    return report


def ipc(args) -> dict:
    import ray
    from gpu_trainer import start_bf16_policy
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from engines import create_vllm_engines, destroy_engines

    pg = placement_group([{"GPU": 1, "CPU": 2}])
    ray.get(pg.ready(), timeout=60)
    engines = create_vllm_engines(
        1, args.model, shared_pg=pg, name_prefix="bench-ipc", enable_sleep_mode=True, **ENGINE
    )
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    policy = start_bf16_policy(args.model, num_cpus=0.2, num_gpus=0.2, scheduling_strategy=strategy)
    try:
        ray.get(engines[0].ready.remote(), timeout=TIMEOUT_S)
        report = two_syncs(ray, policy, engines, transport="cuda_ipc")
        copy_s = ray.get(policy.time_device_copy.remote(report["bytes"]), timeout=TIMEOUT_S)
    finally:
        ray.kill(policy)
        destroy_engines(engines)
        remove_placement_group(pg)
    return {"report": report, "raw_seconds": copy_s, "raw": "on-device copy (torch copy_)"}


def nccl(args) -> dict:
    import ray
    from gpu_trainer import start_bf16_policy

    from engines import create_vllm_engines, destroy_engines
    from engines.weight_sync.broadcast import free_port

    engines = create_vllm_engines(1, args.model, name_prefix="bench-nccl", **ENGINE)
    policy = start_bf16_policy(args.model, num_cpus=1, num_gpus=1)
    try:
        ray.get(engines[0].ready.remote(), timeout=TIMEOUT_S)
        report = two_syncs(ray, policy, engines, transport="broadcast", backend="nccl")
    finally:
        ray.kill(policy)
        destroy_engines(engines)
    peer = ray.remote(num_gpus=1, num_cpus=1)(RawPeer)
    peers = [peer.remote() for _ in range(2)]
    host, port = ray.util.get_node_ip_address(), free_port()
    times = ray.get(
        [p.run.remote(host, port, rank, report["bytes"], 5) for rank, p in enumerate(peers)],
        timeout=TIMEOUT_S,
    )
    for p in peers:
        ray.kill(p)
    return {"report": report, "raw_seconds": max(times), "raw": "NCCL broadcast (PyNccl)"}


def weight_sync(args, sections: list[str]) -> dict:
    import ray

    ray.init(address="local", include_dashboard=False, namespace="gpu-bench-sync")
    figures = {}
    try:
        if "ipc" in sections:
            figures["ipc"] = ipc(args)
        if "nccl" in sections:
            figures["nccl"] = nccl(args)
    finally:
        ray.shutdown()
    print("\n== weight sync: the whole model, bf16, second of two syncs, verify on ==")
    print(
        f"{'':22}{'bytes':>14}{'transfer s':>12}{'GB/s':>8}{'total s':>10}"
        f"{'raw s':>10}{'raw GB/s':>10}{'transfer/raw':>14}"
    )
    for name, fig in figures.items():
        r = fig["report"]
        transfer = r["phases"]["transfer"]
        rate, raw_rate = r["bytes"] / transfer / 1e9, r["bytes"] / fig["raw_seconds"] / 1e9
        print(
            f"{name:22}{r['bytes']:>14,}{transfer:>12.4f}{rate:>8.1f}{r['seconds']:>10.3f}"
            f"{fig['raw_seconds']:>10.5f}{raw_rate:>10.1f}{rate / raw_rate:>14.3f}"
        )
        print(f"  phases {r['phases']}; raw = {fig['raw']}; buckets {r['buckets']}")
    return {"weight_sync": figures}
