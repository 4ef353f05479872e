"""Engine start-up, ours against plain, side by side in one run (issues 16, 34).

    python3 benchmarks/startup.py [--backend vllm|hf] [--model DIR] [--enforce-eager]
                                  [--states cold,warm] [--pairs 3] [--replace] [--json out.json]

vllm (GPU): plain `vllm.LLM(...)` in a fresh process, timed from its launch,
  in vLLM's default environment (as its users start it: no setting of ours;
  a setting our actors need is ours to pay), against
  `create_vllm_engines(num_engines=1, ...)` until `ready()`, same model and
  engine arguments. Each start has its own compile cache directory
  (`VLLM_CACHE_ROOT`): empty for "cold", filled by that side's first cold
  start for "warm". The two sides alternate (plain first in even pairs, ours
  first in odd ones), `--pairs` pairs per state; it prints each start, the
  medians with their spread (min-max) and the ratio of the medians, and the
  breakdown of each side's median start: ours from the engine's
  `StartupReport` (Ray's part, imports, the vLLM engine), vLLM's own split
  read from its log lines, plus the first request.
hf (CPU): the same with our transformers engine against a fresh process that
  imports torch and transformers and loads the tokenizer and model.
--replace: after the states, a set with one warm spare (when the cluster has
  a second GPU; always on CPU): kill the engine, time the spare's swap to
  its first answer; then kill only its engine (vLLM's engine-core process,
  SIGKILL; the CPU engine's generation thread) and time its restart in the
  live actor; then kill the actor and time a new engine on the warm cache.
  Each line is also compared with the median cold start of ours.

Every child process has a deadline (--child-timeout); the JSON (--json) is
written after each start, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The GPU tests' model (tests/gpu/gpu_helpers.py): a random 0.28B Llama in bf16.
MODEL_SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, dtype="bfloat16", init_std=0.02)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
FIRST_TOKENS = 8
RESULT = "STARTUP_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--model", help="model directory (default: built once, shared)")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile/graphs")
    parser.add_argument("--states", default="cold,warm", help="cold, warm or both (cold,warm)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs per state")
    parser.add_argument("--replace", action="store_true", help="also time replacements")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--cache-root", help="compile caches go under it (default: a temp dir)")
    parser.add_argument("--child-timeout", type=float, default=420.0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=["plain", "ours", "replace"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    states = [s for s in args.states.split(",") if s]
    if not states or set(states) - {"cold", "warm"}:
        parser.error(f"--states takes cold, warm or cold,warm; got {args.states!r}")
    args.state_list = states
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.model and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model!r} is not a model directory (no config.json)")
    return args


def vllm_settings(args) -> dict:
    """The same engine arguments on both sides (prefix caching: vLLM's default
    is on, ours off)."""
    return dict(
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
    )


# --- children (each in a fresh process) ------------------------------------------------
def child_plain(args) -> dict:
    launched = float(os.environ["STARTUP_LAUNCHED"])
    began = time.time()
    if args.backend == "vllm":
        import vllm

        imported = time.time()
        llm = vllm.LLM(model=args.model, max_model_len=args.max_len, seed=0, **vllm_settings(args))
        ready = time.time()
        params = vllm.SamplingParams(max_tokens=FIRST_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        first = time.time()
        llm.llm_engine.engine_core.shutdown()
        version = vllm.__version__
    else:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        imported = time.time()
        AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        ready = time.time()
        with torch.inference_mode():
            model.generate(
                torch.tensor([PROMPT]), max_new_tokens=FIRST_TOKENS, min_new_tokens=FIRST_TOKENS
            )
        first = time.time()
        version = torch.__version__
    return {
        "ready_s": ready - launched,
        "phases": {
            "python start": began - launched,
            "imports": imported - began,
            "engine (LLM init)" if args.backend == "vllm" else "tokenizer + model load": ready
            - imported,
        },
        "first_request_s": first - ready,
        "version": version,
    }


def ray_init():
    import ray

    ray.init(
        address="local", include_dashboard=False, namespace="startup-bench", log_to_driver=True
    )
    return ray


def engine_kwargs(args) -> dict:
    kwargs = vllm_settings(args) if args.backend == "vllm" else {}
    kwargs.pop("gpu_memory_utilization", None)
    kwargs.pop("enable_prefix_caching", None)
    return kwargs


def create(args, **extra):
    from engines import create_vllm_engines

    return create_vllm_engines(
        1,
        args.model,
        args.max_len,
        args.gpu_memory_utilization if args.backend == "vllm" else None,
        seed=0,
        enable_prefix_caching=False,
        backend=args.backend,
        name_prefix=f"startup-{os.getpid()}",
        **engine_kwargs(args),
        **extra,
    )


def first_request(engine, timeout_s: float) -> None:
    from engines import SamplingParams
    from engines.client import get

    get(
        engine.generate.remote(PROMPT, SamplingParams(max_tokens=FIRST_TOKENS, ignore_eos=True)),
        timeout_s,
    )


def child_ours(args) -> dict:
    from engines import destroy_engines
    from engines.client import get

    started = time.time()
    ray = ray_init()
    ray_s = time.time() - started
    begin = time.time()
    engines = create(args)
    created = time.time()
    try:
        get(engines[0].ready.remote(), args.child_timeout)
        ready = time.time()
        first_request(engines[0], 120)
        first = time.time()
        report = get(engines[0].startup_report.remote(), 60)
    finally:
        destroy_engines(engines)
        ray.shutdown()
    phases = {"placement group (create_vllm_engines)": created - begin}
    phases.update(actor_phases(report, created, ready))
    return {
        "ready_s": ready - begin,
        "ray_init_s": ray_s,
        "phases": phases,
        "vllm_phases": {p.name: p.seconds for p in report.vllm_phases},
        "fork_wait_s": report.fork_wait_s,
        "first_request_s": first - ready,
    }


def actor_phases(report, created: float, ready: float) -> dict[str, float]:
    """An actor's start from its `.remote()` (at `created`) to `ready()`
    answering (at `ready`): Ray's part, then the phases the actor timed."""
    phases = {"Ray worker start (to the actor's first import)": report.imports_started - created}
    phases.update({f"actor: {p.name}": p.seconds for p in report.phases})
    phases["ready() answered"] = ready - report.ready_at
    return phases


def stop(engine) -> None:
    """The engine "dies": shut down first, so its GPU memory is free for the
    engine started on its GPU next (a killed engine core frees it only once
    it notices), then killed."""
    import ray

    from engines.client import get

    get(engine.shutdown.remote(), 60)
    ray.kill(engine, no_restart=True)


def end_engine(engine, backend: str, timeout_s: float) -> None:
    """The engine dies under its live actor: vLLM's engine core is killed
    (SIGKILL; the benchmark runs on the engine's host), the CPU engine is shut
    down (its generation thread ends). Returns once the actor reports it dead."""
    from engines import EngineDeadError
    from engines.client import get

    if backend == "vllm":
        for pid in get(engine.health.remote(), timeout_s)["engine_core_pids"]:
            os.kill(pid, signal.SIGKILL)
    else:
        get(engine.shutdown.remote(), timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            get(engine.health.remote(), timeout_s)
        except EngineDeadError:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the engine was not reported dead within {timeout_s:g}s")


def child_replace(args) -> dict:
    """A set with a warm spare where the cluster has room for it: the spare's
    swap; the engine restarted in its actor; a new engine on the (now warm)
    compile cache."""
    from engines import destroy_engines, replace_engine, restart_engine, swap_in_spare
    from engines.client import get

    ray = ray_init()
    room = ray.cluster_resources().get("GPU" if args.backend == "vllm" else "CPU", 0)
    spares = 1 if room >= 2 else 0
    result: dict = {"spare_engines": spares}
    begin = time.time()
    engines = create(args, spare_engines=spares)
    try:
        get(engines[0].ready.remote(), args.child_timeout)
        result["set_ready_s"] = time.time() - begin
        first_request(engines[0], 120)
        if spares:
            get(engines.spares[0].asleep, args.child_timeout)
            stop(engines[0])
            began = time.time()
            swap_in_spare(engines, 0, args.child_timeout)
            first_request(engines[0], 120)
            result["spare_to_first_answer_s"] = time.time() - began
        killed = time.time()
        end_engine(engines[0], args.backend, 60)
        result["death_noticed_s"] = time.time() - killed
        began = time.time()
        if not restart_engine(engines, 0):
            raise RuntimeError("the engine's actor did not take the restart")
        get(engines[0].ready.remote(), args.child_timeout)
        first_request(engines[0], 120)
        result["restart_to_first_answer_s"] = time.time() - began
        report = get(engines[0].startup_report.remote(), 60)
        result["restart_phases"] = {p.name: p.seconds for p in report.phases}
        result["restart_vllm_phases"] = {p.name: p.seconds for p in report.vllm_phases}
        stop(engines[0])
        began = time.time()
        replace_engine(engines, 0)
        created = time.time()
        get(engines[0].ready.remote(), args.child_timeout)
        ready = time.time()
        first_request(engines[0], 120)
        result["new_engine_to_first_answer_s"] = time.time() - began
        report = get(engines[0].startup_report.remote(), 60)
        # Where a new actor's start goes, as the cold start's breakdown:
        # its placement is the dead engine's bundle, so no group is made.
        result["new_engine_phases"] = {"replace_engine()": created - began}
        result["new_engine_phases"].update(actor_phases(report, created, ready))
        result["new_engine_vllm_phases"] = {p.name: p.seconds for p in report.vllm_phases}
        result["new_engine_fork_wait_s"] = report.fork_wait_s
    finally:
        destroy_engines(engines)
        ray.shutdown()
    return result


# --- the parent -----------------------------------------------------------------------------
def run_child(args, kind: str, cache: Path, log: Path) -> dict:
    # Plain runs in the environment its users have; ours sets what its
    # actors need through Ray (engines/env.py), and pays for it here.
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache), STARTUP_LAUNCHED=repr(time.time()))
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", kind, "--model", args.model]
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.child_timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"{kind}: no result within {args.child_timeout:g}s (log {log})"}
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line.removeprefix(RESULT))
            if args.backend == "vllm" and kind in ("plain", "ours"):
                if kind == "plain":
                    from engines.vllm.startup_log import vllm_log_phases

                    result["vllm_phases"] = {p.name: p.seconds for p in vllm_log_phases(text)}
                # vLLM spawns its engine core (a fresh interpreter that imports
                # vLLM again) when it must; plain forks it, ours forks it from
                # the actor's forkserver (engines/vllm/forkserver.py).
                spawned = "Overriding VLLM_WORKER_MULTIPROC_METHOD to 'spawn'" in text
                unspawned = "fork" if kind == "plain" else "fork from our forkserver"
                result["engine_core_start"] = "spawn" if spawned else unspawned
            return result
    tail = "\n".join(text.splitlines()[-15:])
    return {"error": f"{kind} exited {proc.returncode} without a result (log {log}):\n{tail}"}


def default_model(args, work: Path) -> str:
    if args.backend == "hf":
        from engines.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    from engines.tiny_model import build_tiny_model

    return str(build_tiny_model(work / "llama-0.28b", **MODEL_SHAPE))


def total_s(result: dict) -> float:
    return result["ready_s"] + result["first_request_s"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f}  ({min(values):.1f}-{max(values):.1f})"


def median_run(runs: list[dict]) -> dict:
    """The run whose ready time is the median (the lower one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["ready_s"])
    return ordered[(len(ordered) - 1) // 2]


def print_state(state: str, runs: dict[str, list[dict]]) -> float | None:
    """Each start, the medians with their spread and the ratio of medians;
    returns that ratio (None when a side has no successful start)."""
    print(f"\n== {state}: {len(runs['plain'])} alternating pairs ==")
    for side in ("plain", "ours"):
        for i, r in enumerate(runs[side]):
            shown = r["error"] if "error" in r else f"ready {r['ready_s']:.1f}s"
            print(f"  {side} #{i}: {shown}")
    good = {side: [r for r in runs[side] if "error" not in r] for side in runs}
    if not good["plain"] or not good["ours"]:
        return None
    ready = {side: [r["ready_s"] for r in good[side]] for side in good}
    total = {side: [total_s(r) for r in good[side]] for side in good}
    ratio = statistics.median(ready["ours"]) / statistics.median(ready["plain"])
    with_first = statistics.median(total["ours"]) / statistics.median(total["plain"])
    print(f"{'median (min-max), s':44}{'plain':>22}{'ours':>22}{'ours/plain':>12}")
    print(
        f"{'start to ready':44}{spread(ready['plain']):>22}"
        f"{spread(ready['ours']):>22}{ratio:>12.2f}"
    )
    print(
        f"{'... and the first request answered':44}{spread(total['plain']):>22}"
        f"{spread(total['ours']):>22}{with_first:>12.2f}"
    )
    for side in ("plain", "ours"):
        r = median_run(good[side])
        if "engine_core_start" in r:
            print(f"-- {side}: vLLM's engine core started by {r['engine_core_start']}")
        print(f"-- {side}: breakdown of its median start (s)")
        for name, seconds in r["phases"].items():
            print(f"   {name:62}{seconds:>8.2f}")
        for name, seconds in r.get("vllm_phases", {}).items():
            print(f"     vLLM: {name:56}{seconds:>8.2f}")
        if r.get("fork_wait_s") is not None:  # inside the engine's phase too
            label = "its core forked, after the forkserver imported"
            print(f"     {label:62}{r['fork_wait_s']:>8.2f}")
        print(f"   {'first request':62}{r['first_request_s']:>8.2f}")
    return ratio


def cache_for(cache_root: Path, side: str, state: str, pair: int) -> Path:
    """Cold: an empty directory per start. Warm: the side's first cold
    start's directory (filled here first when no cold start ran)."""
    cache = cache_root / side / (f"cold-{pair}" if state == "cold" else "cold-0")
    if state == "cold" and cache.exists():
        raise SystemExit(f"{cache} exists: a cold start needs an empty cache directory")
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        runner = {"plain": child_plain, "ours": child_ours, "replace": child_replace}
        print(RESULT + json.dumps(runner[args.child](args)), flush=True)
        return 0
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    args.model = args.model or default_model(args, work)
    cache_root = Path(args.cache_root or work / "cache")
    results: dict = {
        "backend": args.backend,
        "model": args.model,
        "enforce_eager": args.enforce_eager,
        "max_len": args.max_len,
        "pairs": args.pairs,
        "states": {},
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))

    print(f"model {args.model}; compile caches and logs under {work}", flush=True)
    if "cold" not in args.state_list:
        for side in ("plain", "ours"):
            print(f"filling {side}'s compile cache (not measured) ...", flush=True)
            cache = cache_for(cache_root, side, "cold", 0)
            run_child(args, side, cache, work / f"fill-{side}.log")
    for state in args.state_list:
        runs: dict[str, list[dict]] = {"plain": [], "ours": []}
        results["states"][state] = runs
        for pair in range(args.pairs):
            order = ("plain", "ours") if pair % 2 == 0 else ("ours", "plain")
            for side in order:
                print(f"{state} pair {pair}: {side} ...", flush=True)
                cache = cache_for(cache_root, side, state, pair)
                log = work / f"{state}-{pair}-{side}.log"
                runs[side].append(run_child(args, side, cache, log))
                save()
        results[f"{state}_ratio_of_medians"] = print_state(state, runs)
        save()
    if args.replace:
        print("replacement ...", flush=True)
        replaced = run_child(args, "replace", cache_root / "ours" / "cold-0", work / "replace.log")
        results["replace"] = replaced
        save()
        print(f"\n== replacement ==\n{json.dumps(replaced, indent=2)}")
        colds = [
            r["ready_s"]
            for r in results["states"].get("cold", {}).get("ours", [])
            if "ready_s" in r
        ]
        cold = statistics.median(colds) if colds else None
        keys = ("spare_to_first_answer_s", "restart_to_first_answer_s")
        for key in (*keys, "new_engine_to_first_answer_s"):
            if cold and key in replaced:
                print(
                    f"{key}: {replaced[key]:.1f}s = "
                    f"{replaced[key] / cold:.2f} x our median cold start"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
