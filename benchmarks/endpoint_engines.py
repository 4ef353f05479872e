"""Engines serving the OpenAI endpoint, for the endpoint benchmarks
(agent_replay.py, openai_vs_actor.py): vLLM engines on the GPU (several share
one GPU when the host has one), or CPU engines with `--backend hf`; and
`in_clients`, which drives an endpoint from several client processes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_bench_sync import LLAMA_8B

#: The tiny models' positions (`engines.tiny_model`), the 0.28B one's too.
DEFAULT_MAX_LEN = 4096
#: The GPU suite's model: a random Llama of 0.28B parameters, byte-level vocabulary.
MODEL_SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, dtype="bfloat16", init_std=0.02)
READY_TIMEOUT_S = 900


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--small", action="store_true", help="a small run (CPU, CI boxes)")
    parser.add_argument("--model", help="default: the tiny model (hf) or a built 0.28B one (vllm)")
    parser.add_argument(
        "--shape",
        choices=("0.28b", "8b"),
        default="0.28b",
        help="vllm: the built model's shape; 8b is Llama-3-8B's layers with vLLM's dummy "
        "weights (a model whose GPU work per token is a real one's)",
    )
    parser.add_argument(
        "--max-len",
        type=int,
        help="the engines' max model length; default: the model's positions "
        f"({LLAMA_8B['max_position_embeddings']} for 8b, {DEFAULT_MAX_LEN} otherwise)",
    )
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--clients", type=int, default=8, help="client processes driving the endpoint"
    )


def max_len(args) -> int:
    """--max-len, else the positions of the model the engines serve."""
    if args.max_len:
        return args.max_len
    built_8b = args.backend == "vllm" and args.shape == "8b" and not args.model
    return LLAMA_8B["max_position_embeddings"] if built_8b else DEFAULT_MAX_LEN


def model_path(args) -> str:
    if args.model:
        return args.model
    if args.backend == "hf":
        from engines.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    # The 8B copy's name holds its positions: a copy built before they were
    # raised (4,096) is not taken for this one.
    tag = f"8b-{LLAMA_8B['max_position_embeddings']}" if args.shape == "8b" else args.shape
    path = os.path.join(tempfile.gettempdir(), f"bench-llama-{tag}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if args.shape == "8b":
        from gpu_bench_sync import build_sparse_model

        # The byte-level vocabulary of the tiny models, so every sampled id decodes.
        build_sparse_model(Path(path), {**LLAMA_8B, "vocab_size": 320})
    else:
        from engines.tiny_model import build_tiny_model

        build_tiny_model(path, **MODEL_SHAPE)
    return path


@dataclass
class Served:
    """Engines up, each serving its endpoint."""

    engines: Any  # the EngineSet
    urls: list[str]
    model: str
    placement_group: Any = None

    @property
    def api_key(self) -> str:
        return self.engines.api_key

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        from engines import destroy_engines

        destroy_engines(self.engines)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def serve(args, count: int, *, prefix_caching: bool, name: str) -> Served:
    """`count` engines of `args.backend` with the endpoint on; on a host with
    one GPU they share it (a placement group of fractional bundles)."""
    import ray

    from engines import create_vllm_engines

    # A CPU engine takes a CPU of Ray's: on a small box, more engines than
    # cores share them (the CPU run exercises the code, its speed is no figure).
    cpus = max(os.cpu_count() or 1, count) if args.backend == "hf" else None
    ray.init(address="local", include_dashboard=False, namespace=name, num_cpus=cpus)
    model = model_path(args)
    kwargs: dict[str, Any] = {}
    pg = None
    if args.backend == "vllm":
        import torch
        from ray.util.placement_group import placement_group

        share = torch.cuda.device_count() < count
        if share:
            pg = placement_group([{"GPU": 1 / count, "CPU": 1}] * count, strategy="PACK")
            ray.get(pg.ready(), timeout=60)
        kwargs = dict(
            gpu_memory_utilization=0.8 / count if share else 0.6,
            shared_pg=pg,
            enforce_eager=args.eager,
        )
        if args.shape == "8b" and not args.model:
            kwargs["load_format"] = "dummy"  # its checkpoint is all zeros (a sparse file)
    start = time.monotonic()
    engines = create_vllm_engines(
        num_engines=count,
        pretrain=model,
        max_len=max_len(args),
        backend=args.backend,
        name_prefix=name,
        enable_prefix_caching=prefix_caching,
        openai_api=True,
        **kwargs,
    )
    urls = ray.get([e.openai_url.remote() for e in engines], timeout=READY_TIMEOUT_S)
    print(f"{count} {args.backend} engine(s) serving in {time.monotonic() - start:.0f}s: {urls}")
    return Served(engines=engines, urls=urls, model=model, placement_group=pg)


@dataclass
class ClientsRun:
    """One workload driven from `clients` processes."""

    clients: int
    seconds: float  # from the common start until the last client finished
    results: list[Any]  # each client's, in client order
    cpu_seconds: float  # the clients' CPU time, summed


async def _timed(target, index: int, clients: int, payload, barrier) -> tuple[Any, float]:
    used: list[float] = []

    async def start() -> None:
        await asyncio.to_thread(barrier.wait)
        used.append(time.process_time())

    result = await target(index, clients, payload, start)
    return result, time.process_time() - used[0]


def _client(target, index: int, clients: int, payload, barrier, results) -> None:
    try:
        result, cpu = asyncio.run(_timed(target, index, clients, payload, barrier))
        results.put((index, result, cpu))
    except BaseException as exc:
        barrier.abort()  # the driver stops waiting for this client
        results.put((index, RuntimeError(f"client {index} failed: {exc!r}"), 0.0))
        raise


def in_clients(target: Callable[..., Coroutine], clients: int, payload: Any) -> ClientsRun:
    """`await target(index, clients, payload, start)` (a module-level coroutine
    function that takes its share of the work) in `clients` processes at once.
    A target warms up (its client's first request imports and builds much of
    `openai`), then awaits `start()`: the clock and the CPU count start once
    every process is there."""
    context = multiprocessing.get_context("spawn")  # never fork a Ray driver
    barrier, results = context.Barrier(clients + 1), context.Queue()
    processes = [
        context.Process(target=_client, args=(target, i, clients, payload, barrier, results))
        for i in range(clients)
    ]
    for process in processes:
        process.start()
    try:
        with contextlib.suppress(threading.BrokenBarrierError):  # a client's error follows
            barrier.wait(timeout=READY_TIMEOUT_S)
        start = time.monotonic()
        done = [results.get(timeout=READY_TIMEOUT_S) for _ in processes]
        seconds = time.monotonic() - start
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    for _, result, _ in done:
        if isinstance(result, Exception):
            raise result
    done.sort(key=lambda d: d[0])
    return ClientsRun(clients, seconds, [d[1] for d in done], sum(d[2] for d in done))
