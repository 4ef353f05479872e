"""Weight-sync figures on the H200 hosts: our syncs against the raw operation
on the same bytes, for models of several sizes, printed side by side.

    python3 benchmarks/gpu_bench_sync.py [--sizes 0.28b,7b] [--syncs 5] [--json out.json]

Per size: one vLLM engine (eager) on GPU 0, and two trainers holding bf16
weights of the engine's layout: one on GPU 0 (CUDA IPC, colocated) and one on
GPU 1 (bucketed NCCL broadcast; skipped on a one-GPU host). The CUDA IPC
trainer syncs `--syncs` times without the probe after each sync, then as many
times with it (`engines/weight_sync/probe.py`: the engine's logprobs of a
fixed 16-token prompt against the trainer's, computed by transformers on the
weights sent; the sync returns with its verdict); the table shows both side
by side, with the probe's share of the sync call (its cost to the engine's
first batch, which the target of at most +5% is about, is
benchmarks/probe_cost.py's) and CUDA IPC's rate against the on-device
copy's (target: at least 0.8). The trainer's reference
forward is timed apart (`reference_s`): it is the trainer's work, done before
the sync starts, like the optimizer step.
Raw: one on-device copy of the same bytes on GPU 0 (the floor of a CUDA IPC
sync: the engine must copy every byte into its own weights once), and one
NCCL broadcast of the same bytes from GPU 1 to GPU 0 (vLLM's PyNccl, as our
group uses). Each trainer syncs `--syncs` times (new weights every time); the
first syncs pay one-time set-up (the engine records its copy plan, CUDA IPC
handles are opened); the table shows the median of the last three.

The 0.28B model is the GPU tests' model (random weights, written with
transformers). The 7B model has Llama-3-8B's layer shapes (hidden 4096, 32
layers, MLP 14336, 32/8 heads, 8,192 positions; vocabulary 32,000): the engine starts from
vLLM's dummy weights (`load_format="dummy"`), its checkpoint is a sparse
safetensors file (headers only: the engines read their layout from it), and
the trainers send random bf16 tensors. The values do not change how fast bytes move.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIMEOUT_S = 300
ENGINE = dict(max_len=2048, gpu_memory_utilization=0.3, backend="vllm", enforce_eager=True)
SMALL = dict(layers=24, hidden=896, heads=14, kv_heads=2, dtype="bfloat16", init_std=0.02)
LLAMA_8B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    # Llama-3-8B's context: the endpoint benchmarks' agent traces need it.
    max_position_embeddings=8192,
)


def build_sparse_model(path: Path, shape: dict) -> Path:
    """A Llama checkpoint of `shape` whose tensors are all zeros and take no
    disk space (a sparse file): enough for an engine started with
    `load_format="dummy"`, which reads only config, tokenizer and headers."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engines.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * 2
        span = [offset, offset + nbytes]
        header[name] = {"dtype": "BF16", "shape": list(param.shape), "data_offsets": span}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class SyncPeer:
    """A trainer for the benchmark: bf16 weights in the engine's layout (HF
    names, as the checkpoint's headers list them) on its GPU, and our senders."""

    def __init__(self, model_dir: str):
        import torch

        from engines.weight_sync.transports import checkpoint

        self.device = torch.device("cuda", torch.cuda.current_device())
        generator = torch.Generator(self.device).manual_seed(0)
        self.weights = []
        for spec in checkpoint.read_manifest(model_dir).params:
            tensor = torch.empty(spec.shape, dtype=torch.bfloat16, device=self.device)
            tensor.normal_(0.0, 0.02, generator=generator)
            self.weights.append((spec.name, tensor))
        self.model_dir = model_dir
        self.model = None  # transformers' model on these very tensors, for the probe
        self.sender = None

    def probe_reference(self) -> Any:
        """The probe's reference logprobs, computed by transformers on the
        weights the trainer sends (its model made once, on those tensors)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from engines.weight_sync.probe import reference

        if self.model is None:
            config = AutoConfig.from_pretrained(self.model_dir)
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            # assign: the model's parameters become the trainer's tensors.
            model.load_state_dict(dict(self.weights), assign=True)
            self.model = model.eval()
            torch.cuda.empty_cache()
        return reference(self.model, self.model.config.vocab_size, torch.bfloat16)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.weights)

    def connect(self, engines: list, transport: str) -> None:
        from engines.weight_sync import BroadcastSender, CudaIpcSender, SyncConfig

        config = SyncConfig(timeout_s=120.0)
        if transport == "nccl":
            self.sender = BroadcastSender(config, backend="nccl", device=self.device)
        else:
            self.sender = CudaIpcSender(config)
        self.sender.init(engines)

    def sync(self, version: int, probe: bool = False) -> dict:
        import torch

        # New weights in place, as an optimizer step leaves them. Timed from
        # weights that are ready, as the raw copy is: the step's kernels (7 ms
        # at 7B) are the trainer's time, and would otherwise run under the
        # sync's first call. So is the probe's reference forward.
        with torch.no_grad():
            for _, tensor in self.weights:
                tensor.mul_(1.001)
        started = time.perf_counter()
        reference = self.probe_reference() if probe else None
        torch.cuda.synchronize(self.device)
        reference_s = time.perf_counter() - started
        try:
            report = self.sender.sync(self.weights, version, reference).as_dict()
        except Exception as exc:  # noqa: BLE001 - a figure of the run: shown, not fatal
            return {"version": version, "error": repr(exc)}
        return {**report, "reference_s": reference_s if probe else None}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def device_copy_seconds(self, nbytes: int, repeats: int = 5) -> float:
        """Best of `repeats` on-device copies of `nbytes`."""
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def engine_call_ms(self, engines: list, calls: int = 50, gap_s: float = 0.0) -> float:
        """Median round trip of a no-op engine call (`weight_status`) from
        this trainer: what each of a sync's control calls costs at least.
        With `gap_s`, both sides sit idle that long before each call, as they
        do between a sync's calls while the GPU copies."""
        import ray

        times = []
        for _ in range(calls):
            time.sleep(gap_s)
            start = time.perf_counter()
            ray.get(engines[0].weight_status.remote(), timeout=TIMEOUT_S)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e3

    def checksum_seconds(self, repeats: int = 5) -> float:
        """Best of `repeats` checksums of one 1 GiB bucket (what verification
        adds on each side per bucket)."""
        import torch

        from engines.weight_sync.formats.checksum import device_sums

        data = torch.empty(1 << 30, dtype=torch.uint8, device=self.device)
        best = float("inf")
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            device_sums(data)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def raw_broadcast_seconds(self, host: str, port: int, rank: int, nbytes: int) -> float:
        """Mean of 5 bare NCCL broadcasts of `nbytes` from rank 0 (no buckets,
        no control calls), after a warm-up."""
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=2)
        comm = PyNcclCommunicator(group, device=self.device)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        comm.broadcast(buffer, src=0)
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(5):
            comm.broadcast(buffer, src=0)
        torch.cuda.synchronize(self.device)
        seconds = (time.perf_counter() - start) / 5
        del buffer
        comm.destroy()
        return seconds


def bench_size(ray, name: str, model_dir: Path, syncs: int, two_gpus: bool) -> dict:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from engines import create_vllm_engines, destroy_engines
    from engines.weight_sync.group import free_port

    dummy = {"load_format": "dummy"} if name != "0.28b" else {}
    pg = placement_group([{"GPU": 1, "CPU": 2}])
    ray.get(pg.ready(), timeout=60)
    peer_cls = ray.remote(SyncPeer)
    near = peer_cls.options(
        num_cpus=0.2,
        num_gpus=0.2,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    ).remote(str(model_dir))
    far = peer_cls.options(num_cpus=1, num_gpus=1).remote(str(model_dir)) if two_gpus else None
    # The trainers' memory is taken before vLLM measures what it may use.
    ray.get([p.nbytes.remote() for p in (near, far) if p is not None], timeout=TIMEOUT_S)
    started = time.time()
    engines = create_vllm_engines(
        1, str(model_dir), shared_pg=pg, name_prefix=f"bench-{name}", **ENGINE, **dummy
    )
    figures: dict[str, Any] = {}
    try:
        ray.get(engines[0].ready.remote(), timeout=TIMEOUT_S)
        figures["engine_ready_s"] = time.time() - started
        nbytes = ray.get(near.nbytes.remote(), timeout=TIMEOUT_S)
        figures["bytes"] = nbytes
        version = 0
        for transport, peer in (("ipc", near), ("nccl", far)):
            if peer is None:
                continue
            ray.get(peer.connect.remote(engines, transport), timeout=TIMEOUT_S)
            # CUDA IPC: the same trainer, warm, then with the probe after each sync.
            for series, probe in ((transport, False), ("ipc_probe", True)):
                if probe and transport != "ipc":
                    continue
                reports = []
                for _ in range(syncs):
                    version += 1
                    sync = peer.sync.remote(version, probe)
                    reports.append(ray.get(sync, timeout=TIMEOUT_S))
                figures[series] = {"reports": reports}
            ray.get(peer.close.remote(), timeout=TIMEOUT_S)
        # Whether the engine replays recorded copies instead of load_weights.
        figures["copy_plan"] = ray.get(
            engines[0].collective_rpc.remote("copy_plan_status"), timeout=TIMEOUT_S
        )
        figures["engine_call_ms"] = ray.get(near.engine_call_ms.remote(engines), timeout=TIMEOUT_S)
        figures["engine_call_after_idle_ms"] = ray.get(
            near.engine_call_ms.remote(engines, gap_s=0.01), timeout=TIMEOUT_S
        )
        copy = near.device_copy_seconds.remote(nbytes)
        figures["ipc"]["raw_s"] = figures["ipc_probe"]["raw_s"] = ray.get(copy, timeout=TIMEOUT_S)
        figures["checksum_s_per_gib"] = ray.get(near.checksum_seconds.remote(), timeout=TIMEOUT_S)
    finally:
        destroy_engines(engines)
    if far is not None:
        host, port = ray.util.get_node_ip_address(), free_port()
        times = ray.get(
            [
                p.raw_broadcast_seconds.remote(host, port, rank, nbytes)
                for rank, p in enumerate((far, near))
            ],
            timeout=TIMEOUT_S,
        )
        figures["nccl"]["raw_s"] = max(times)
    for peer in (near, far):
        if peer is not None:
            ray.kill(peer)
    remove_placement_group(pg)
    return figures


def model_dir(name: str, root: Path) -> Path:
    path = root / f"bench-llama-{name}"
    if not (path / "config.json").exists():
        if name == "0.28b":
            from engines.tiny_model import build_tiny_model

            build_tiny_model(path, **SMALL)
        else:
            build_sparse_model(path, LLAMA_8B)
    return path


IPC_SERIES = ("ipc", "ipc_probe")


def steady(reports: list[dict]) -> dict | None:
    """The median of the last three syncs by total (the steady state)."""
    last = [r for r in reports[-3:] if "error" not in r]
    return sorted(last, key=lambda r: r["seconds"])[len(last) // 2] if last else None


def print_table(results: dict) -> None:
    print("\n== weight sync: the whole model, bf16, one engine; median of the last 3 syncs ==")
    print(
        f"{'':18}{'bytes':>16}{'transfer s':>12}{'total s':>10}{'GB/s':>8}"
        f"{'raw s':>10}{'raw GB/s':>10}{'total/raw rate':>16}"
    )
    for size, figures in results.items():
        for series in ("ipc", "ipc_probe", "nccl"):
            if series not in figures:
                continue
            fig, nbytes = figures[series], figures["bytes"]
            for failed in (r for r in fig["reports"] if "error" in r):
                print(f"  {size} {series}: sync v{failed['version']} failed: {failed['error']}")
            last = steady(fig["reports"])
            if last is None:
                continue
            rate, raw_rate = nbytes / last["seconds"] / 1e9, nbytes / fig["raw_s"] / 1e9
            print(
                f"{size + ' ' + series:18}{nbytes:>16,}{last['phases']['transfer']:>12.4f}"
                f"{last['seconds']:>10.4f}{rate:>8.1f}{fig['raw_s']:>10.5f}{raw_rate:>10.1f}"
                f"{rate / raw_rate:>16.3f}"
            )
            totals = ", ".join(f"{r.get('seconds', float('nan')):.4f}" for r in fig["reports"])
            print(f"  every sync's total s: {totals}; median's phases {last['phases']}")
            print(f"  inside the engine (median sync): {last.get('engine_times', {})}")
            # *_at: when the engine actor / worker took and answered the call,
            # in ms since the trainer's sync() began (the way in to the copies).
            times = last.get("engine_times", {}).items()
            way = {k: round(v * 1e3, 2) for k, v in times if k.endswith("_at")}
            print(f"  the way in, ms into the sync: {way}")
            if last.get("probe"):
                reference = last["reference_s"]
                shown = "none" if reference is None else f"{reference:.4f}s"
                print(f"  probe: {last['probe']}; trainer's reference {shown}")
        plain, probed = (steady(figures.get(k, {}).get("reports", [])) for k in IPC_SERIES)
        if plain and probed:
            added = probed["seconds"] / plain["seconds"] - 1
            rate = figures["ipc"]["raw_s"] / plain["seconds"]
            print(
                f"  {size}: the probe adds {added:+.1%} to a CUDA IPC sync call; "
                f"CUDA IPC at {rate:.3f} of the on-device copy's rate (target >= 0.8)"
            )
        print(f"  {size}: engine ready in {figures['engine_ready_s']:.1f}s")
        print(f"  {size}: copy plan {figures['copy_plan']}")
        print(f"  {size}: checksum of 1 GiB {figures['checksum_s_per_gib'] * 1e3:.2f} ms")
        print(
            f"  {size}: a no-op engine call from the trainer {figures['engine_call_ms']:.2f} ms "
            f"back to back, {figures['engine_call_after_idle_ms']:.2f} ms after 10 ms idle"
        )


def weight_sync(sizes: list[str], syncs: int, root: Path) -> dict:
    import ray
    import torch

    two_gpus = torch.cuda.device_count() >= 2
    dirs = {size: model_dir(size, root) for size in sizes}
    ray.init(address="local", include_dashboard=False, namespace="gpu-bench-sync")
    if __name__ != "__main__":  # imported: Ray workers cannot import benchmarks/
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    results = {}
    try:
        for size in sizes:
            results[size] = bench_size(ray, size, dirs[size], syncs, two_gpus)
    finally:
        ray.shutdown()
    print_table(results)
    return {"weight_sync": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.28b,7b")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--models", default=tempfile.gettempdir(), help="where models are built")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    figures = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv}
    figures.update(weight_sync(args.sizes.split(","), args.syncs, Path(args.models)))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
