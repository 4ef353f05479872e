"""Engine start-up, ours against plain, side by side in one run (issues 16, 34).

    python3 benchmarks/startup.py [--backend vllm|hf] [--model DIR] [--enforce-eager]
                                  [--states cold,warm] [--pairs 3] [--replace] [--json out.json]
                                  [--resume]

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
  a second GPU; always on CPU) and one prepared actor: kill the engine, time
  the spare's swap to its first answer; then kill only its engine (vLLM's
  engine-core process, SIGKILL; the CPU engine's generation thread) and time
  its restart in the live actor; then kill the actor and time the engine
  started in the prepared actor; then kill that and time a new engine actor
  on the warm cache.
  Each line is also compared with the median cold start of ours.

Every child process has a deadline (--child-timeout); the JSON (--json) is
written after each start, so a run cut short keeps what it measured.
--resume: add this call's pairs to those already in --json (same model,
  compile caches and backend; pairs go on alternating where they stopped),
  and print the medians over all of them: 3 pairs of cold and warm starts
  take longer than one device call may run, so they are split over calls
  on one machine.
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

from benchmarks import startup_children  # noqa: E402

#: The GPU tests' model (tests/gpu/gpu_helpers.py): a random 0.28B Llama in bf16.
MODEL_SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, dtype="bfloat16", init_std=0.02)


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
    parser.add_argument("--resume", action="store_true", help="add pairs to those in --json")
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
    if args.resume and args.child is None:
        if args.json is None or not args.json.is_file():
            parser.error(f"--resume needs the --json of an earlier run; got {args.json}")
        if args.model or args.cache_root:
            parser.error("--resume takes the model and compile caches of the run it resumes")
    return args


def resumed(args) -> dict:
    """The results of the run --resume goes on with, checked to be usable
    here: same backend and engine arguments, its model and caches still on disk."""
    results = json.loads(args.json.read_text())
    for key in ("backend", "enforce_eager", "max_len", "gpu_memory_utilization"):
        if results.get(key) != getattr(args, key):
            raise SystemExit(
                f"--resume: {args.json} has {key}={results.get(key)!r}, this call {key}="
                f"{getattr(args, key)!r}; pairs are only comparable with the same settings"
            )
    for key in ("model", "cache_root"):
        if not results.get(key) or not Path(results[key]).is_dir():
            raise SystemExit(
                f"--resume: the {key} of {args.json} ({results.get(key)}) is gone; "
                "a resumed run must be on the machine of the run it resumes"
            )
    return results


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
        if line.startswith(startup_children.RESULT):
            result = json.loads(line.removeprefix(startup_children.RESULT))
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
        startup_children.run(args)
        return 0
    results = resumed(args) if args.resume else None  # refused before anything is made
    # Kept after the run: the children's logs, and (without --cache-root)
    # the compile caches that a warm start or a later --resume reuses.
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    if results:
        args.model = results["model"]
    else:
        args.model = args.model or default_model(args, work)
        results = {
            "backend": args.backend,
            "model": args.model,
            "cache_root": str(Path(args.cache_root or work / "cache")),
            "enforce_eager": args.enforce_eager,
            "max_len": args.max_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "states": {},
        }
    cache_root = Path(results["cache_root"])

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))

    print(f"model {args.model}; compile caches and logs under {work}", flush=True)
    for side in ("plain", "ours"):
        if "cold" not in args.state_list and not (cache_root / side / "cold-0").exists():
            print(f"filling {side}'s compile cache (not measured) ...", flush=True)
            cache = cache_for(cache_root, side, "cold", 0)
            run_child(args, side, cache, work / f"fill-{side}.log")
    for state in args.state_list:
        runs = results["states"].setdefault(state, {"plain": [], "ours": []})
        done = max(len(runs["plain"]), len(runs["ours"]))  # a cut call may leave half a pair
        for pair in range(done, done + args.pairs):
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
        keys += ("prepared_to_first_answer_s", "new_engine_to_first_answer_s")
        for key in keys:
            if cold and key in replaced:
                print(
                    f"{key}: {replaced[key]:.1f}s = "
                    f"{replaced[key] / cold:.2f} x our median cold start"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
