"""The schedules of the on-policy flow side by side: `sync`, `overlap`,
`in_flight` and `partial`, each one real run of the rollout flow on the same
task, seed and settings, one after the other in this process. Not a test:
it prints numbers. Tasks (`--workload`): the letter task
(training/letter_task.py), or the long-tail length mix (training/long_tail.py:
5% of the rows run to 8192 tokens / --scale, the others end within 512 /
--scale; sampled with ignore_eos), where `--sync-seeds 3` runs `sync` three
times for the reward's spread.

    python benchmarks/schedules.py                      # CPU: the tiny model, hf engines
    python benchmarks/schedules.py --backend vllm --gpu-model --prompts 64 --n 16 \\
        --max-tokens 96 --steps 6 --json schedules.json  # 2 GPUs: engine / policy
    python benchmarks/schedules.py --workload long-tail --schedules sync,partial \\
        --sync-seeds 3 --scale 32 --prompts 16 --n 4 --steps 6   # CPU, small scale
    python benchmarks/schedules.py --backend vllm --gpu-model --colocate --workload long-tail \\
        --scale 16 --prompts 32 --n 8 --steps 3 --partial-wait 2 --learning-rate 0.00005 \\
        --schedules sync,partial --sync-seeds 3 --seeds 3   # one GPU, engine and policy on it

Per schedule: training steps per hour over the iterations (start-up excluded:
engines and policy load once per run), the ratio to `sync`, the reward after
the fixed number of steps, the most stale row, the mean seconds of
generate / train / sync, of the rest (`other s`: hand-offs, bookkeeping, the
stop of what `partial` left running) and of engine and policy idle time per
iteration, and whether the run's rows pass benchmarks/row_checks.py.
`partial_stop`: the `partial` schedule with partial_keep_generating off;
`partial_next`: with partial_start_next on (the next iteration's groups
start beside the policy step); to compare them.
`--gpu-model` builds the GPU tests' 0.28B model (random weights, bf16); the
policy trains it in float32 on its own GPU and syncs it over NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from benchmarks.schedule_run import ScheduleRun  # noqa: E402
from benchmarks.schedules_report import report  # noqa: E402

SCHEDULES = ("sync", "overlap", "in_flight", "partial", "partial_stop", "partial_next")
#: `partial_stop`: `partial` with partial_keep_generating off (the groups not
#: taken are aborted when the batch is complete, not at the sync).
#: `partial_next`: `partial` with partial_start_next on.
FLOW_SCHEDULE = {"partial_stop": "partial", "partial_next": "partial"}
WORKLOADS = ("letter", "long-tail")
LETTER_REWARD = "training.letter_task:reward"
#: The GPU tests' model (tests/gpu/gpu_helpers.py).
GPU_MODEL_SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, dtype="bfloat16", init_std=0.02)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--steps", type=int, default=6, help="iterations (training steps) per run")
    parser.add_argument("--prompts", type=int, default=16, help="letter-task prompts")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--num-engines", type=int, help="default: 2 (hf), 1 (vllm: one GPU)")
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument(
        "--reward",
        default=LETTER_REWARD,
        help="reward import path; the letter task's saturates (groups agree, steps train on "
        "nothing), training.rewards:target_chars_fraction keeps every group's signal",
    )
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--workload", choices=WORKLOADS, default="letter")
    parser.add_argument(
        "--scale", type=int, default=1, help="long-tail: divide every length by this (CPU: 32)"
    )
    parser.add_argument(
        "--partial-wait",
        type=int,
        default=4,
        help="partial: iterations a group may wait (its max_staleness)",
    )
    parser.add_argument("--partial-in-flight", type=float, default=1.5)
    parser.add_argument(
        "--sync-seeds", type=int, default=1, help="runs of sync (seeds seed, seed+1, ...)"
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="runs of each other schedule (seeds seed, ...)"
    )
    parser.add_argument(
        "--colocate", action="store_true", help="vLLM: the policy on the engines' GPU"
    )
    parser.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="what the policy's step computes in (bfloat16: under torch.autocast)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--prompts-seed",
        type=int,
        help="the workload's rows drawn from this seed (default: --seed), so that seeds "
        "split over several calls (--seed 43) run on one prompts file",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a one-step run first, not timed, so no schedule pays the process's first-run costs",
    )
    parser.add_argument(
        "--gpu-model", action="store_true", help="the GPU tests' 0.28B model, not the tiny one"
    )
    parser.add_argument("--model", help="a model directory instead of a built one")
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM: no CUDA graphs (engines start in seconds, not a minute)",
    )
    parser.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="leave groups whose rewards agree out of each step and refill the batch",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.prompts_seed is None:
        args.prompts_seed = args.seed
    if args.num_engines is None:
        args.num_engines = 1 if args.backend == "vllm" else 2
    return args


def build_model(args: argparse.Namespace, workdir: Path) -> str:
    from engines.tiny_model import build_tiny_model, ensure_tiny_model

    if args.model:
        return args.model
    if args.gpu_model:
        # The long tail at --scale 1 or 2 runs past the 4,096 positions
        # the model has by default, and vLLM refuses a longer max_len.
        positions = max(4096, max_len(args))
        return str(
            build_tiny_model(workdir / "llama-0.28b", **GPU_MODEL_SHAPE, max_positions=positions)
        )
    return str(ensure_tiny_model())


def max_len(args: argparse.Namespace) -> int:
    """A sequence's longest: the prompt (the long tail's are under 64
    tokens) and its samples' budget."""
    return max(128, args.max_tokens + 64)


def params_for(
    args: argparse.Namespace, schedule: str, model: str, prompts: Path, out: Path, seed: int
):
    from flows.params import RolloutParams, sectioned

    on_gpu = args.backend == "vllm"
    flow_schedule = FLOW_SCHEDULE.get(schedule, schedule)
    staleness = {"partial": args.partial_wait, "sync": None}.get(flow_schedule, args.max_staleness)
    fields = dict(
        prompts_path=str(prompts),
        label_field="answer",
        id_field="id",
        reward=args.reward,
        model=model,
        backend=args.backend,
        num_engines=args.num_engines,
        n=args.n,
        max_tokens=args.max_tokens,
        max_len=max_len(args),
        iterations=args.steps,
        learning_rate=args.learning_rate,
        compute_dtype=args.compute_dtype,
        seed=seed,
        schedule=flow_schedule,
        dynamic_sampling=args.dynamic_sampling,
        **({"max_staleness": staleness} if staleness is not None else {}),
        output_dir=str(out),
        output_format="jsonl",
        gpu_memory_utilization=0.3 if on_gpu else 0.85,
        engine_kwargs={"enforce_eager": True} if on_gpu and args.enforce_eager else {},
    )
    # Each schedule's own knobs only: the run refuses the others (flows/params.py).
    if flow_schedule == "partial":
        fields["partial_keep_generating"] = schedule != "partial_stop"
        fields["partial_start_next"] = schedule == "partial_next"
        fields["partial_in_flight"] = args.partial_in_flight
    else:
        fields["shard_size"] = max(1, args.prompts // (2 * args.num_engines))
    if args.workload == "long-tail":
        fields["ignore_eos"] = True  # each sample runs its row's max_tokens
    if args.colocate:
        fields["colocate"] = True
    return RolloutParams.model_validate(sectioned(fields))


def run_one(params, schedule: str) -> ScheduleRun:
    from benchmarks.row_checks import check_rows, newest_version_reward, prompt_rewards
    from flows.rollout import rollout

    state = rollout(params, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"the {schedule} run failed: {state.message}")
    summary = state.result()
    rows = summary.training

    def mean(field: str) -> float:
        return statistics.fmean(getattr(row, field) or 0.0 for row in rows)

    # A batch: one group of n per row of the prompts file, under every schedule.
    batch = len(Path(params.data.prompts_path).read_text().splitlines())
    run_dir = Path(summary.output_dir)
    checks = check_rows(
        run_dir, len(rows), batch * params.sampling.n, params.training.staleness_bound
    )
    newest = newest_version_reward(run_dir, len(rows))
    wall = summary.iterations_seconds
    phases = mean("generate_seconds"), mean("train_seconds"), mean("sync_seconds")
    stopped = any(row.stop_seconds is not None for row in rows)
    return ScheduleRun(
        schedule=schedule,
        seed=params.sampling.seed,
        steps=len(rows),
        iterations_s=wall,
        steps_per_hour=len(rows) * 3600 / wall,
        reward_first=rows[0].mean_reward,
        reward_last=rows[-1].mean_reward,
        newest_version=newest.version,
        reward_newest=newest.reward,
        rows_newest=newest.rows,
        prompts_newest=list(newest.prompts),
        reward_by_prompt=[prompt_rewards(run_dir, i) for i in range(len(rows))],
        run_dir=str(run_dir),
        staleness_max=max(row.staleness_max for row in rows),
        trained_samples=sum(row.trained_samples for row in rows),
        generate_s=phases[0],
        train_s=phases[1],
        sync_s=phases[2],
        other_s=wall / len(rows) - sum(phases),
        engine_idle_s=mean("engine_idle_seconds"),
        policy_idle_s=mean("policy_idle_seconds"),
        engine_idle_fraction=sum(row.engine_idle_seconds or 0.0 for row in rows) / wall,
        checks=asdict(checks) | {"ok": checks.ok},
        iterations=[asdict(row) for row in rows],
        stop_s=mean("stop_seconds") if stopped else None,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    schedules = args.schedules.split(",")
    if unknown := sorted(set(schedules) - set(SCHEDULES)):
        raise SystemExit(f"error: unknown schedules {unknown}; pick from {SCHEDULES}")
    # The model, the prompts, the Prefect home and the runs' rows, checked
    # as each run ends: what is kept is the report (stdout, --json).
    with tempfile.TemporaryDirectory(prefix="rolloutflow-schedules-") as workdir:
        return compare(args, schedules, Path(workdir))


def compare(args: argparse.Namespace, schedules: list[str], workdir: Path) -> int:
    import ray
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_HOME", str(workdir / "prefect"))
    prompts = write_prompts(args, workdir)
    model = build_model(args, workdir)
    where = (
        "GPU: vLLM engines, "
        + ("the policy on their GPU (CUDA IPC" if args.colocate else "a GPU of its own (NCCL")
        + " sync)"
        if args.backend == "vllm"
        else "CPU: the tiny model (hf engines, gloo sync); small numbers, "
        "not the GPU figures of docs/benchmarks.md"
    )
    print(
        f"{where}\n{args.workload}: {args.prompts} prompts x {args.n} samples, up to "
        f"{args.max_tokens} tokens, {args.steps} steps, {args.num_engines} engines, model {model}",
        flush=True,
    )
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="bench-schedules")
    results = []
    began = time.monotonic()
    try:
        with prefect_test_harness(server_startup_timeout=120):
            if args.warmup:
                # The first run of a process pays one-time costs (kernel JIT,
                # the host's caches: 4.7 s against 1 s for the first generation
                # on the H200s) that would count against whichever schedule
                # came first; a one-step run pays them for all.
                warmup = params_for(
                    args, "sync", model, prompts, workdir / "out" / "warmup", args.seed
                )
                run_one(
                    warmup.model_copy(
                        update={"training": warmup.training.model_copy(update={"iterations": 1})}
                    ),
                    "sync",
                )
                print("warm-up run: done", flush=True)
            for schedule, seed in runs(args, schedules):
                out = workdir / "out" / f"{schedule}-{seed}"
                params = params_for(args, schedule, model, prompts, out, seed)
                results.append(run_one(params, schedule))
                print(f"{schedule}: done ({results[-1].iterations_s:.1f} s)", flush=True)
                # After each run: a command cut at its time limit keeps what ran.
                report(args, results, time.monotonic() - began)
    finally:
        ray.shutdown()
    return 0


def write_prompts(args: argparse.Namespace, workdir: Path) -> Path:
    """The workload's prompts file; the long tail sets the run's max_tokens
    to its longest row (each row's own max_tokens is what a sample runs)."""
    if args.workload == "long-tail":
        from training import long_tail

        rows = long_tail.make_rows(args.prompts, args.prompts_seed, args.scale)
        args.max_tokens = max(row["max_tokens"] for row in rows)
        if args.reward == LETTER_REWARD:
            args.reward = "training.rewards:target_chars_fraction"
    else:
        from training.letter_task import make_rows

        rows = make_rows(args.prompts, args.prompts_seed)
    prompts = workdir / f"{args.workload}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return prompts


def runs(args: argparse.Namespace, schedules: list[str]) -> list[tuple[str, int]]:
    """(schedule, seed) of each run: `sync` once per seed of --sync-seeds, the
    others once per seed of --seeds; seed by seed, the schedules alternating
    (so a drift of the machine's speed falls on all of them)."""
    counts = {s: args.sync_seeds if s == "sync" else args.seeds for s in schedules}
    return [
        (schedule, args.seed + k)
        for k in range(max(counts.values()))
        for schedule in schedules
        if k < counts[schedule]
    ]


if __name__ == "__main__":
    raise SystemExit(main())
