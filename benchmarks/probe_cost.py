"""The probe's cost where a rollout pays it: from a sync's start to the first
batch's results released, with the probe minus without, in one run, the two
alternating (off, on, on, off, ...) so that drift cancels. Not a test: it
prints figures.

    python3 benchmarks/probe_cost.py --cpu [--rounds 12]       # CPU engine, tiny model, gloo
    python3 benchmarks/probe_cost.py --size 7b [--rounds 12]   # one GPU: vLLM, CUDA IPC

A round: new weights in place (and, probe on, the trainer's reference
logprobs: its own work, done before the clock starts, as in
benchmarks/gpu_bench_sync.py), then the sync starts in a thread and a batch
of prompts goes to the engine at once, as a dispatcher's next requests wait
at its door. Timed: the batch's results back in the caller, and the sync
call (which returns with the probe's verdict). Probe off: the sync carries
no reference, and the engine runs no probe. The GPU version is
gpu_bench_sync.py's CUDA IPC trainer and engine (`--size 7b`: Llama-3-8B's
shapes, vLLM's dummy weights, random bf16 tensors sent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_bench_sync as bench  # noqa: E402

TIMEOUT_S = 300
#: Probe off and on, in this order, over and over: each is as often first as second.
ORDER = (False, True, True, False)


@dataclass(frozen=True)
class Batch:
    """The first batch after each sync: `prompts` prompts of `length` token
    ids, `max_tokens` greedy tokens each."""

    prompts: int
    length: int
    max_tokens: int
    vocab: int

    def send(self, engine: Any) -> Any:
        from engines.sampling import SamplingParams

        ids = [
            [3 + (7 * i + 13 * j) % (self.vocab - 3) for j in range(self.length)]
            for i in range(self.prompts)
        ]
        return engine.generate.remote(
            ids, SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
        )


@dataclass(frozen=True)
class Round:
    probe: bool
    released_s: float  # the sync's start -> the batch's results back
    sync_s: float  # the sync call, as its report times it
    probe_s: float  # the probe in the engine (its report's), 0 when off
    verdict: str
    #: Every output of the batch ran (at least in part) on the new weights.
    on_new_weights: bool


def timed_round(
    sync: Callable[[], Any], engine: Any, version: int, probe: bool, batch: Batch
) -> Round:
    """Start `sync` (to `version`) and send `batch` at once; time both."""
    import ray

    with ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        syncing = pool.submit(sync)
        try:
            outputs = ray.get(batch.send(engine), timeout=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a figure of the run (a failed probe fails the batch)
            outputs, failed = [], repr(exc)[:200]
        else:
            failed = ""
        released = time.perf_counter() - started
        try:
            report = syncing.result(timeout=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a failed probe: shown, and the next sync repairs
            seconds = time.perf_counter() - started
            return Round(probe, released, seconds, 0.0, f"sync failed: {exc!r}"[:300], False)
    result = report.probe
    verdict = failed or (result.status if result is not None else "none")
    fresh = bool(outputs) and all(version in o.weight_versions for o in outputs)
    probe_s = result.seconds if result is not None and probe else 0.0
    return Round(probe, released, report.seconds, probe_s, verdict, fresh)


def schedule(rounds: int) -> list[tuple[int, bool]]:
    """(version, probe) of each round: two warm-up rounds (one of each), then `rounds`."""
    order = [ORDER[i % len(ORDER)] for i in range(rounds + 2)]
    return list(enumerate(order, start=1))


class GpuTrainer(bench.SyncPeer):
    """gpu_bench_sync.py's trainer (bf16 weights on the engine's GPU, CUDA
    IPC), timing rounds."""

    def round(self, engine: Any, version: int, probe: bool, batch: Batch) -> Round:
        import torch

        with torch.no_grad():
            for _, tensor in self.weights:
                tensor.mul_(1.001)
        reference = self.probe_reference() if probe else None
        torch.cuda.synchronize(self.device)
        sync = partial(self.sender.sync, self.weights, version, reference)
        return timed_round(sync, engine, version, probe, batch)


def gpu_rounds(size: str, rounds: int, batch: Batch, root: Path) -> list[Round]:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from engines import create_vllm_engines, destroy_engines

    path = str(bench.model_dir(size, root))
    ray.init(address="local", include_dashboard=False, namespace="probe-cost")
    ray.cloudpickle.register_pickle_by_value(bench)  # Ray workers cannot import benchmarks/
    pg = placement_group([{"GPU": 1, "CPU": 2}])
    ray.get(pg.ready(), timeout=60)
    colocated = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    trainer = (
        ray.remote(GpuTrainer)
        .options(num_cpus=0.2, num_gpus=0.2, scheduling_strategy=colocated)
        .remote(path)
    )
    ray.get(trainer.nbytes.remote(), timeout=TIMEOUT_S)  # its memory before vLLM sizes its own
    dummy = {} if size == "0.28b" else {"load_format": "dummy"}
    engines = create_vllm_engines(
        1, path, shared_pg=pg, name_prefix="probe-cost", **bench.ENGINE, **dummy
    )
    try:
        ray.get(engines[0].ready.remote(), timeout=TIMEOUT_S)
        ray.get(trainer.connect.remote(engines, "ipc"), timeout=TIMEOUT_S)
        return [
            ray.get(trainer.round.remote(engines[0], version, probe, batch), timeout=TIMEOUT_S)
            for version, probe in schedule(rounds)
        ]
    finally:
        destroy_engines(engines)
        ray.shutdown()


def cpu_rounds(rounds: int, batch: Batch, layers: int, hidden: int) -> list[Round]:
    """The trainer is this process (float32 weights, a gloo broadcast); the
    engine a CPU (`hf`) engine actor."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from engines import create_vllm_engines, destroy_engines
    from engines.tiny_model import build_tiny_model
    from engines.weight_sync import BroadcastSender, SyncConfig
    from engines.weight_sync.probe import reference

    torch.set_num_threads(1)
    folder = tempfile.TemporaryDirectory(prefix="probe-cost-")  # the model, for this run
    path = str(build_tiny_model(os.path.join(folder.name, "model"), layers=layers, hidden=hidden))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = [(name, p.detach()) for name, p in model.named_parameters()]
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="probe-cost")
    engines = create_vllm_engines(
        1, path, max_len=256, gpu_memory_utilization=0.5, backend="hf", name_prefix="probe-cost"
    )
    try:
        ray.get(engines[0].ready.remote(), timeout=600)
        sender = BroadcastSender(SyncConfig(timeout_s=120.0))
        sender.init(engines)
        results = []
        for version, probe in schedule(rounds):
            with torch.no_grad():
                for _, tensor in weights:
                    tensor.mul_(1.001)
            ref = reference(model, model.config.vocab_size, torch.float32) if probe else None
            sync = partial(sender.sync, weights, version, ref)
            results.append(timed_round(sync, engines[0], version, probe, batch))
        sender.close()
        return results
    finally:
        destroy_engines(engines)
        folder.cleanup()
        ray.shutdown()


def report(rounds: list[Round], what: str) -> list[str]:
    """The figures, warm-up rounds left out."""
    timed = rounds[2:]
    off, on = [r for r in timed if not r.probe], [r for r in timed if r.probe]

    def ms(values) -> float:
        return statistics.median(values) * 1e3

    released_off, released_on = ms(r.released_s for r in off), ms(r.released_s for r in on)
    sync_off, sync_on = ms(r.sync_s for r in off), ms(r.sync_s for r in on)
    added = released_on - released_off
    # Each pair of neighbours holds one round of each (ORDER): their
    # difference is taken under the same load, which drifts on a shared box.
    pairs = [timed[i : i + 2] for i in range(0, len(timed) - 1, 2)]
    paired = ms(sum(r.released_s if r.probe else -r.released_s for r in p) for p in pairs)
    fresh = sum(r.on_new_weights for r in timed)
    return [
        f"== the probe's cost, {what}; medians of {len(off)} rounds off, {len(on)} on ==",
        f"first batch's results released: probe off {released_off:.2f} ms, on "
        f"{released_on:.2f} ms: the probe adds {added:+.2f} ms = {added / released_off:+.1%} "
        f"of the batch's latency (target <= +5%), {added / sync_off:+.1%} of the sync "
        f"({sync_off:.2f} ms, probe off); median of the "
        f"{len(pairs)} neighbouring pairs' differences {paired:+.2f} ms",
        f"the sync call (returns with the verdict): off {sync_off:.2f} ms, on {sync_on:.2f} ms "
        f"({sync_on - sync_off:+.2f} ms); the probe in the engine "
        f"{ms(r.probe_s for r in on):.2f} ms",
        f"verdicts (on): {dict(Counter(r.verdict for r in on))}; off: "
        f"{dict(Counter(r.verdict for r in off))}",
        f"rounds whose batch ran on the new weights: {fresh} of {len(timed)}",
        "every round (probe, released ms, sync ms): "
        + ", ".join(
            f"{'on' if r.probe else 'off'} {r.released_s * 1e3:.1f} {r.sync_s * 1e3:.1f}"
            for r in rounds
        ),
    ]


def _row(r: Round) -> str:
    return f"{'on' if r.probe else 'off'} {r.released_s * 1e3:.1f} {r.sync_s * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU engine and a tiny model")
    parser.add_argument("--size", default="7b", help="GPU: gpu_bench_sync.py's 0.28b or 7b")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=None, help="default: 8 (CPU), 32 (GPU)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8, help="CPU model")
    parser.add_argument("--hidden", type=int, default=256, help="CPU model")
    parser.add_argument(
        "--models", default=tempfile.gettempdir(), help="where GPU models are built"
    )
    args = parser.parse_args()
    if args.cpu:
        batch = Batch(args.prompts or 8, args.prompt_len, args.max_tokens, vocab=200)
        rounds = cpu_rounds(args.rounds, batch, args.layers, args.hidden)
        what = f"CPU engine, tiny model ({args.layers} layers x {args.hidden}), gloo broadcast"
    else:
        batch = Batch(args.prompts or 32, args.prompt_len, args.max_tokens, vocab=32000)
        rounds = gpu_rounds(args.size, args.rounds, batch, Path(args.models))
        what = f"{args.size}, vLLM, CUDA IPC, one GPU"
    what += f"; first batch {batch.prompts} x {batch.length} tokens, {batch.max_tokens} new"
    print("\n".join(report(rounds, what)))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
