"""The start-up benchmark's children (`benchmarks/startup.py`), each run in
a fresh process by the parent: plain vLLM (or transformers on the CPU)
timed from its launch; ours, `create_vllm_engines` to `ready()`; and the
replacements. Each prints one line, `RESULT` and its JSON, for the parent
to read from the child's log."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
FIRST_TOKENS = 8
RESULT = "STARTUP_RESULT "


def vllm_settings(args) -> dict:
    """The same engine arguments on both sides (prefix caching: vLLM's default
    is on, ours off)."""
    return dict(
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
    )


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
    """A set with a warm spare where the cluster has room for it, and a
    prepared actor: the spare's swap; the engine restarted in its actor; its
    actor lost and the prepared actor in its place; a new engine actor on the
    (now warm) compile cache."""
    from engines import (
        adopt_prepared,
        destroy_engines,
        replace_engine,
        restart_engine,
        swap_in_spare,
    )
    from engines.client import get

    ray = ray_init()
    room = ray.cluster_resources().get("GPU" if args.backend == "vllm" else "CPU", 0)
    spares = 1 if room >= 2 else 0
    result: dict = {"spare_engines": spares}
    begin = time.time()
    engines = create(args, spare_engines=spares, prepared_actors=1)
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
        result.update(serving_again(engines[0], began, "restart", args.child_timeout))
        # Its actor lost as in a crash (killed, no shutdown first): the
        # prepared actor, up since the set started, takes its place.
        result["prepared_imports_s"] = get(engines.prepared[0].up, args.child_timeout).seconds
        began = time.time()
        ray.kill(engines[0], no_restart=True)
        if adopt_prepared(engines, 0) is None:
            raise RuntimeError("the prepared actor did not take the lost engine's place")
        result.update(serving_again(engines[0], began, "prepared", args.child_timeout))
        # A new actor, with no prepared one left (the successor ends here).
        for prepared in engines.prepared:
            ray.kill(prepared.handle, no_restart=True)
        engines.prepared.clear()
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


def serving_again(engine, began: float, way: str, timeout_s: float) -> dict:
    """A replacement begun at `began` (`way`: restart, prepared) once it
    answered its first request: the seconds, and its start's phases."""
    from engines.client import get

    get(engine.ready.remote(), timeout_s)
    first_request(engine, 120)
    seconds = time.time() - began
    report = get(engine.startup_report.remote(), 60)
    return {
        f"{way}_to_first_answer_s": seconds,
        f"{way}_phases": {p.name: p.seconds for p in report.phases},
        f"{way}_vllm_phases": {p.name: p.seconds for p in report.vllm_phases},
        f"{way}_fork_wait_s": report.fork_wait_s,
    }


def run(args: argparse.Namespace) -> None:
    """Run the child `args.child` and print its result for the parent."""
    runner = {"plain": child_plain, "ours": child_ours, "replace": child_replace}
    print(RESULT + json.dumps(runner[args.child](args)), flush=True)
