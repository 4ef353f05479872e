"""GPU figures, ours against plain vLLM, printed side by side (H200 hosts; see
docs/benchmarks.md for results and tests/gpu/README.md for running there).

    python3 benchmarks/gpu_bench.py [--json out.json]

rollout: the same model, prompts and sampling through `vllm.LLM.generate` in
  a plain process, then through `create_vllm_engines` + our `generate`:
  start-up to ready (both cold: vLLM's compile cache is off) and output
  tokens/s (median of --repeats timed runs after a warm-up), as a ratio.
Weight-sync figures: benchmarks/gpu_bench_sync.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, dtype="bfloat16", init_std=0.02)
# A fresh compile per engine on both sides: otherwise whichever starts second
# reuses the first one's torch.compile cache and looks faster.
COLD_ENV = {"VLLM_DISABLE_COMPILE_CACHE": "1"}


def workload(args) -> tuple[list[list[int]], dict]:
    """Prompts of random byte tokens (deterministic), and sampling as in RL
    rollouts: temperature 1, fixed output length."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = dict(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    return prompts, sampling


def engine_kwargs(args) -> dict:
    # Prefix caching off on both sides (vLLM's default is on, ours off).
    return dict(
        max_model_len=args.max_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
    )


# --- plain vLLM (a child process) ------------------------------------------------
def plain_vllm(args) -> None:
    """Runs in its own process: `vllm.LLM` exactly as its docs show it."""
    started = float(os.environ["GPU_BENCH_LAUNCHED"])
    import vllm

    prompts, sampling = workload(args)
    begin = time.time()
    llm = vllm.LLM(model=args.model, seed=0, **engine_kwargs(args))
    ready = time.time()
    params = vllm.SamplingParams(**sampling)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[: args.warmup], params, use_tqdm=False)
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        runs.append(tokens / seconds)
    llm.llm_engine.engine_core.shutdown()  # frees the GPU; see the GPU README's pitfalls
    print(
        "PLAIN_RESULT "
        + json.dumps(
            {
                "startup_s": ready - started,
                "llm_init_s": ready - begin,
                "tok_per_s_runs": runs,
                "vllm": vllm.__version__,
            }
        ),
        flush=True,
    )


def run_plain(args) -> dict:
    env = dict(os.environ, **COLD_ENV, GPU_BENCH_LAUNCHED=repr(time.time()))
    cmd = [sys.executable, __file__, "--plain", *sys.argv[1:]]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=900)
    sys.stdout.write(proc.stdout)
    for line in proc.stdout.splitlines():
        if line.startswith("PLAIN_RESULT "):
            return json.loads(line.removeprefix("PLAIN_RESULT "))
    raise RuntimeError(f"plain vLLM run failed (exit {proc.returncode}); output above")


# --- ours (Ray actor) -------------------------------------------------------------------
def run_ours(args) -> dict:
    import ray

    from engines import SamplingParams, create_vllm_engines, destroy_engines

    prompts, sampling = workload(args)
    params = SamplingParams(**sampling)
    os.environ.update(COLD_ENV)  # inherited by the Ray cluster started below
    start = time.time()
    ray.init(address="local", include_dashboard=False, namespace="gpu-bench")
    ray_s = time.time() - start
    start = time.time()
    engines = create_vllm_engines(
        num_engines=1,
        pretrain=args.model,
        max_len=args.max_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=1,
        seed=0,
        backend="vllm",
        name_prefix="gpu-bench",
    )
    engine = engines[0]
    try:
        ray.get(engine.ready.remote(), timeout=600)
        startup = time.time() - start
        ray.get(engine.generate.remote(prompts[: args.warmup], params), timeout=600)
        chunks = [prompts[i : i + args.chunk] for i in range(0, len(prompts), args.chunk)]
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            # Concurrent calls, as rollout workers send them: they share batches.
            results = ray.get([engine.generate.remote(c, params) for c in chunks], timeout=600)
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for r in results for o in r for c in o.outputs)
            runs.append(tokens / seconds)
    finally:
        destroy_engines(engines)
        ray.shutdown()
    return {"startup_s": startup, "ray_init_s": ray_s, "tok_per_s_runs": runs}


def rollout(args) -> dict:
    plain = run_plain(args)
    ours = run_ours(args)
    p_tps = statistics.median(plain["tok_per_s_runs"])
    o_tps = statistics.median(ours["tok_per_s_runs"])
    print(
        f"\n== rollout: {args.prompts} prompts x {args.prompt_len} tokens in, "
        f"{args.max_tokens} out, temperature 1, one H200, CUDA graphs on =="
    )
    print(f"{'':34}{'plain vllm.LLM':>16}{'ours (Ray actor)':>18}{'ours/plain':>12}")
    print(f"{'output tokens/s (median)':34}{p_tps:>16,.0f}{o_tps:>18,.0f}{o_tps / p_tps:>12.3f}")
    print(
        f"{'start-up to ready (s)':34}{plain['startup_s']:>16.1f}{ours['startup_s']:>18.1f}"
        f"{ours['startup_s'] / plain['startup_s']:>12.2f}"
    )
    print(
        f"  plain: LLM() itself {plain['llm_init_s']:.1f}s (the rest is Python + vLLM import); "
        f"ours: ray.init {ours['ray_init_s']:.1f}s before create_vllm_engines (not counted)"
    )
    print(
        f"  runs tok/s: plain {[round(r) for r in plain['tok_per_s_runs']]}, "
        f"ours {[round(r) for r in ours['tok_per_s_runs']]}"
    )
    return {"plain": plain, "ours": ours, "ratio": o_tps / p_tps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "bench-llama-0.28b"))
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--chunk", type=int, default=64, help="prompts per generate call (ours)")
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.plain:
        plain_vllm(args)
        return
    figures = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv}
    if not (Path(args.model) / "config.json").exists():
        from engines.tiny_model import build_tiny_model

        build_tiny_model(args.model, **MODEL_SHAPE)
    figures["rollout"] = rollout(args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
