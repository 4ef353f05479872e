"""The reference policy's train step at the long tail's lengths, and where
its time goes: `ReferencePolicy.train_step` on groups shaped as
`benchmarks/schedules.py --workload long-tail` makes them (one group of `n`
per row of `training.long_tail`, every sample its row's length, behaviour
logprobs attached), timed over `--steps` steps after one warm-up, the last
under torch's profiler. `--autocast`: each step also under a bf16 autocast
(mixed precision: bf16 matmuls and attention, the weights and their
update float32), alternating with the float32 step, to weigh it
before the policy takes it. Not a test: it prints figures.

    python3 benchmarks/policy_step.py --gpu --scale 4 --prompts 32 --n 8   # GPU long tail's
    python3 benchmarks/policy_step.py --gpu --autocast   # and under a bf16 autocast, alternating
    python3 benchmarks/policy_step.py --scale 32 --prompts 16 --n 4        # CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.schedules import GPU_MODEL_SHAPE  # noqa: E402

PROMPT_TOKENS = 40  # the long tail's prompts, byte-tokenized, with their template


def make_groups(prompts: int, n: int, scale: int, seed: int, vocab: int) -> list[dict]:
    from training.long_tail import make_rows

    rng = random.Random(seed)
    groups = []
    for row in make_rows(prompts, seed=seed, scale=scale):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
        samples = []
        for _ in range(n):
            length = int(row["max_tokens"])
            samples.append(
                {
                    "prompt_token_ids": prompt,
                    "completion_token_ids": [rng.randrange(3, vocab) for _ in range(length)],
                    "logprobs": [-rng.uniform(4.0, 7.0) for _ in range(length)],
                    "weight_version": 0,
                    "reward": rng.random(),
                }
            )
        groups.append({"samples": samples})
    return groups


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gpu", action="store_true", help="CUDA and the GPU model (else the CPU, the tiny model)"
    )
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=25, help="profiler rows printed")
    parser.add_argument(
        "--autocast",
        action="store_true",
        help="also time the step under torch.autocast(bfloat16), alternating with float32",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (the last is profiled), got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The GPU model is built for the run and goes with it (the CPU's tiny
    # model is the cached one).
    with tempfile.TemporaryDirectory(prefix="policy-step-") as workdir:
        measure(args, Path(workdir))


def measure(args: argparse.Namespace, workdir: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engines.tiny_model import build_tiny_model, ensure_tiny_model
    from training.policy import ReferencePolicy

    model = (
        str(build_tiny_model(workdir / "llama-0.28b", **GPU_MODEL_SHAPE))
        if args.gpu
        else str(ensure_tiny_model())
    )
    policy = ReferencePolicy(
        {
            "pretrain": model,
            "device": "cuda" if args.gpu else "cpu",
            "learning_rate": 5e-5,
            "max_staleness": 8,
            "micro_batch_tokens": args.micro_batch_tokens,
        }
    )
    groups = make_groups(args.prompts, args.n, args.scale, args.seed, vocab=259)
    tokens = sum(
        len(s["prompt_token_ids"]) + len(s["completion_token_ids"])
        for g in groups
        for s in g["samples"]
    )
    print(f"{args.prompts} groups of {args.n}, {tokens} tokens, on {policy.device}", flush=True)
    # float32 (the policy's step as it runs) and, with --autocast, the same
    # step under a bf16 autocast, alternating step by step on one policy.
    modes = {"float32": nullcontext}
    if args.autocast:
        modes["bf16 autocast"] = partial(torch.autocast, policy.device.type, dtype=torch.bfloat16)
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for context in modes.values():
        with context():
            policy.train_step(groups)  # warm-up: allocator, kernels, the optimizer's state
    sort = "cuda_time_total" if args.gpu else "cpu_time_total"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.gpu else [])
    for step in range(args.steps):
        last = step == args.steps - 1
        for mode, context in modes.items():
            with profile(activities=activities) if last else nullcontext() as prof, context():
                if args.gpu:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                report = policy.train_step(groups)
                if args.gpu:
                    torch.cuda.synchronize()
                seconds[mode].append(time.perf_counter() - started)
            took = f"{seconds[mode][-1]:.3f} s (report {report.seconds:.3f} s)"
            print(f"step {step + 1}, {mode}: {took}", flush=True)
            if last:
                print(prof.key_averages().table(sort_by=sort, row_limit=args.rows), flush=True)
    medians = {mode: statistics.median(s) for mode, s in seconds.items()}
    result = {
        "tokens": tokens,
        "steps_s": seconds["float32"],
        "median_s": medians["float32"],
        "device": str(policy.device),
    }
    if args.autocast:
        result["autocast_steps_s"] = seconds["bf16 autocast"]
        result["autocast_median_s"] = medians["bf16 autocast"]
        print(
            f"median step: float32 {medians['float32']:.3f} s, bf16 autocast "
            f"{medians['bf16 autocast']:.3f} s ({medians['bf16 autocast'] / medians['float32']:.2f}"
            " of float32; the last step of each under the profiler)",
            flush=True,
        )
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
