"""The weight-sync probe's false-alarm and catch rates: how often it flags a
correct sync, and how often it catches a silently corrupted one. Not a
test: it prints a line per case and writes the figures as JSON after each.

    python3 benchmarks/probe_rates.py --cpu [--syncs 20] [--json rates.json]
    python3 benchmarks/probe_rates.py --sizes 0.28b,7b [--syncs 20] [--json rates.json]

A case: `--syncs` correct syncs (the trainer's weights move by a step's
worth of noise, then are sent), each probed, and as many corrupted ones,
the three corruptions in turn: two layers' tensors swapped by name, one
weight scaled by 1.1-1.5, one weight's rows permuted (the reference is the
trainer's true weights; the engine gets the corrupted ones). A false alarm
is a correct sync flagged; a catch a corrupted one flagged.

--cpu: the tiny model in this process, the verdict from the probe's own
`check` on an engine model that holds the weights sent in the engine's dtype
and computes in it (as the CPU engine does): float32 sent as float32, a
float32 trainer sending bf16 (as the policy does to a bf16 engine), a bf16
trainer, and a float32 trainer in train() mode with dropout.

GPU (one H200): gpu_bench_sync.py's engine and CUDA IPC trainer (vLLM,
eager; bf16 weights sent; the 0.28B model and Llama-3-8B's shapes), each
sync a real sync whose probe runs in the engine; about 5 minutes per shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CORRUPTIONS = ("swap", "scale", "permute")


@dataclass
class Rates:
    """One case's counts, the tolerance of each sync, and the mean |difference|
    of each correct sync (`diffs`) and each corrupted one (CPU only)."""

    case: str
    tolerance: list[float] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)
    corrupted_diffs: list[float] = field(default_factory=list)
    false_alarms: int = 0
    correct: int = 0
    caught: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CORRUPTIONS, 0))
    corrupted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CORRUPTIONS, 0))

    def count(self, syncs: int, one_sync: Callable[[str | None], bool]) -> None:
        """`syncs` correct syncs and as many corrupted ones, the corruptions in
        turn; `one_sync(kind)` makes one (None: correct), True if flagged."""
        for i in range(syncs):
            self.correct += 1
            self.false_alarms += one_sync(None)
            kind = CORRUPTIONS[i % len(CORRUPTIONS)]
            self.corrupted[kind] += 1
            self.caught[kind] += one_sync(kind)

    def line(self) -> str:
        caught = ", ".join(f"{k} {self.caught[k]}/{self.corrupted[k]}" for k in CORRUPTIONS)
        worst = max(self.diffs, default=0.0)
        return (
            f"{self.case}: false alarms {self.false_alarms}/{self.correct}; caught "
            f"{sum(self.caught.values())}/{sum(self.corrupted.values())} ({caught}); "
            f"tolerance {min(self.tolerance):.3g}-{max(self.tolerance):.3g}, "
            f"mean |diff| of the correct at most {worst:.3g}"
            + (
                f", of the corrupted at least {min(self.corrupted_diffs):.3g}"
                if self.corrupted_diffs
                else ""
            )
        )


def corrupt(weights: dict[str, Any], kind: str, rng: random.Random) -> dict[str, Any]:
    """`weights` (name -> tensor) with one silent corruption; the tensors
    not touched are the same objects."""
    import torch

    matrices = sorted(name for name, t in weights.items() if t.dim() == 2)
    out = dict(weights)
    if kind == "swap":
        layered = [n for n in matrices if ".layers.0." in n]
        first = rng.choice(layered)
        second = first.replace(".layers.0.", ".layers.1.")
        out[first], out[second] = weights[second], weights[first]
    elif kind == "scale":
        name = rng.choice(matrices)
        out[name] = weights[name] * rng.uniform(1.1, 1.5)
    else:
        name = rng.choice(matrices)
        rows = torch.randperm(
            weights[name].shape[0], generator=torch.Generator().manual_seed(rng.randrange(2**31))
        )
        out[name] = weights[name][rows]
    return out


class Host:
    """What `probe.check` asks of an engine: its logprobs of the probe prompt."""

    def __init__(self, model: Any):
        self.model = model

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        from engines.weight_sync.probe import sequence_logprobs

        return sequence_logprobs(self.model, token_ids)

    def served_quantization(self) -> None:
        return None  # the CPU engine serves the dtype sent


@dataclass(frozen=True)
class CpuCase:
    name: str
    trainer: str
    sent: str
    dropout: float = 0.0


CPU_CASES = (
    CpuCase("cpu float32 -> float32", "float32", "float32"),
    CpuCase("cpu float32 -> bf16", "float32", "bfloat16"),
    CpuCase("cpu bf16 -> bf16", "bfloat16", "bfloat16"),
    CpuCase("cpu float32 train() dropout 0.1 -> bf16", "float32", "bfloat16", dropout=0.1),
)


def cpu_case(case: CpuCase, model_dir: str, syncs: int, noise: float, seed: int) -> Rates:
    import torch
    from transformers import AutoModelForCausalLM

    from engines.weight_sync.errors import ProbeMismatchError
    from engines.weight_sync.probe import check, reference, sequence_logprobs

    torch.manual_seed(seed)
    rng = random.Random(seed)
    trainer = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, case.trainer), attention_dropout=case.dropout
    )
    trainer.train(case.dropout > 0)
    engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, case.sent)).eval()
    engine_params = dict(engine.named_parameters())
    sent = getattr(torch, case.sent)
    rates = Rates(case.name)

    def one_sync(kind: str | None) -> bool:
        """A step, a sync (corrupted by `kind`), the probe; True: flagged."""
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * noise * p.std())
            weights = {n: p.detach().to(sent) for n, p in trainer.named_parameters()}
            if kind is not None:
                weights = corrupt(weights, kind, rng)
            for name, tensor in weights.items():
                engine_params[name].copy_(tensor)
        probe = reference(trainer, trainer.config.vocab_size, sent)
        rates.tolerance.append(probe.tolerance)
        got = sequence_logprobs(engine, probe.token_ids)
        diff = sum(abs(g - r) for g, r in zip(got, probe.logprobs, strict=True)) / len(got)
        (rates.diffs if kind is None else rates.corrupted_diffs).append(diff)
        try:
            asyncio.run(check(Host(engine), probe, case.name))
        except ProbeMismatchError:
            return True
        return False

    rates.count(syncs, one_sync)
    return rates


def run_cpu(args: argparse.Namespace, write) -> None:
    from engines.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="probe-rates-") as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "tiny"))
        for case in CPU_CASES:
            write(cpu_case(case, model_dir, args.syncs, args.noise, args.seed))


def run_gpu(args: argparse.Namespace, write) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from benchmarks import gpu_bench_sync as bench
    from engines import create_vllm_engines, destroy_engines

    ray.init(address="local", include_dashboard=False)
    with tempfile.TemporaryDirectory(prefix="probe-rates-") as tmp:
        for size in args.sizes.split(","):
            model_dir = str(bench.model_dir(size, Path(tmp)))
            # As gpu_bench_sync.py: the trainer's memory is taken before vLLM sizes its own.
            pg = placement_group([{"GPU": 1, "CPU": 2}])
            ray.get(pg.ready(), timeout=60)
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            peer = (
                ray.remote(GpuPeer)
                .options(num_cpus=0.2, num_gpus=0.2, scheduling_strategy=strategy)
                .remote(model_dir)
            )
            dummy = {"load_format": "dummy"} if size != "0.28b" else {}
            engines = []
            try:
                ray.get(peer.nbytes.remote(), timeout=bench.TIMEOUT_S)
                engines = create_vllm_engines(
                    1, model_dir, shared_pg=pg, name_prefix=f"rates-{size}", **bench.ENGINE, **dummy
                )
                ray.get(engines[0].ready.remote(), timeout=bench.TIMEOUT_S)
                ray.get(peer.connect.remote(engines, "ipc"), timeout=bench.TIMEOUT_S)
                counts = ray.get(
                    peer.rates.remote(f"vllm {size} bf16 -> bf16", args.syncs, args.seed),
                    timeout=args.case_timeout_s,
                )
                write(Rates(**counts))
            finally:
                ray.get(peer.close.remote(), timeout=60)
                destroy_engines(engines)
                ray.kill(peer)
                remove_placement_group(pg)


class GpuPeer:
    """gpu_bench_sync's CUDA IPC trainer, syncing correct and corrupted weights."""

    def __init__(self, model_dir: str):
        from benchmarks import gpu_bench_sync as bench

        self.peer = bench.SyncPeer(model_dir)

    def nbytes(self) -> int:
        return self.peer.nbytes()

    def connect(self, engines: list, transport: str) -> None:
        self.peer.connect(engines, transport)

    def close(self) -> None:
        self.peer.close()

    def rates(self, case: str, syncs: int, seed: int) -> dict:
        import torch

        from engines.weight_sync.errors import ProbeMismatchError

        rng, peer, rates = random.Random(seed), self.peer, Rates(case)
        version = 0

        def one_sync(kind: str | None) -> bool:
            nonlocal version
            version += 1
            with torch.no_grad():
                for _, tensor in peer.weights:
                    tensor.add_(torch.randn_like(tensor) * 0.002)
            probe = peer.probe_reference()
            rates.tolerance.append(probe.tolerance)
            weights = dict(peer.weights)
            if kind is not None:
                weights = corrupt(weights, kind, rng)
            try:
                report = peer.sender.sync(list(weights.items()), version, probe)
            except ProbeMismatchError:
                return True
            if kind is None:
                rates.diffs.append(report.probe.mean_diff)
            return False

        one_sync(None)  # set-up: the engine's copy plan, IPC handles
        rates.count(syncs, one_sync)
        return asdict(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model, in this process")
    parser.add_argument("--sizes", default="0.28b,7b", help="GPU: gpu_bench_sync.py's sizes")
    parser.add_argument("--syncs", type=int, default=20, help="correct syncs, and corrupted")
    parser.add_argument("--noise", type=float, default=0.02, help="CPU: a step, x each std")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case-timeout-s", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="write the cases' figures here, after each")
    args = parser.parse_args()
    done: list[dict] = []

    def write(rates: Rates) -> None:
        print(rates.line(), flush=True)
        done.append(asdict(rates))
        if args.json:
            args.json.write_text(json.dumps(done, indent=1))

    (run_cpu if args.cpu else run_gpu)(args, write)


if __name__ == "__main__":
    main()
