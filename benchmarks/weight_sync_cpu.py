"""Weight sync on CPU: bucketed broadcast vs one call per parameter (the
OpenRLHF path), and both against a plain memcpy of the same bytes, in one run
on the same model and engines. Not a test: it reports numbers.

    python benchmarks/weight_sync_cpu.py [--layers 16 --hidden 256 --engines 1 --repeats 3]

The trainer is this process (rank 0 of a gloo group); the engines are CPU
(`hf`) engine actors on a local Ray. Verification is off while timing the
transfer (it is reported on its own row).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")

logger = logging.getLogger("weight_sync_cpu")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, nargs="+", default=[1024, 4])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logger.setLevel(logging.INFO)

    import ray
    import torch

    from engines import create_vllm_engines, destroy_engines
    from engines.client import call_engines, raise_first_error
    from engines.tiny_model import build_tiny_model
    from engines.weight_sync import BroadcastSender, Manifest, SyncConfig
    from engines.weight_sync.formats.buckets import plan_buckets
    from engines.weight_sync.transports.checkpoint import iter_tensors

    torch.set_num_threads(1)
    folder = tempfile.TemporaryDirectory(prefix="wsync-bench-")  # the model, for this run
    model_dir = build_tiny_model(
        os.path.join(folder.name, "model"),
        layers=args.layers,
        hidden=args.hidden,
    )
    weights = list(iter_tensors(model_dir))
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        namespace="wsync-bench",
        logging_level=logging.WARNING,
    )
    engines = create_vllm_engines(
        args.engines, str(model_dir), 64, 0.5, backend="hf", name_prefix="wsync-bench"
    )
    try:
        ray.get([e.ready.remote() for e in engines], timeout=600)
        sender = BroadcastSender(SyncConfig(timeout_s=120, verify=False))
        sender.init(engines)
        version = [0]

        def next_version() -> int:
            version[0] += 1
            return version[0]

        def bucketed(bucket_bytes: int):
            sender.config = SyncConfig(bucket_bytes=bucket_bytes, timeout_s=120, verify=False)
            return lambda: sender.sync(weights, next_version())

        def per_parameter() -> None:
            # OpenRLHF's loop: per parameter, one call per engine, then the
            # broadcast, then wait; the last call commits (version + 1).
            for count, (name, tensor) in enumerate(weights, start=1):
                refs = [
                    e.update_weight.remote(
                        name, tensor.dtype, list(tensor.shape), empty_cache=count == len(weights)
                    )
                    for e in engines
                ]
                sender.group.broadcast(tensor, src=0)
                ray.get(refs, timeout=120)
            version[0] += 1

        src = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in weights])
        dst = torch.empty_like(src)

        rows = []
        memcpy_s = median_time(lambda: dst.copy_(src), max(args.repeats, 5))
        rows.append(("memcpy (torch copy_, same bytes)", 0, 0, memcpy_s))
        for mib in args.bucket_mib:
            sync = bucketed(mib << 20)
            sync()  # warm-up: first use of buffers and connections
            seconds = median_time(sync, args.repeats)
            buckets = len(plan_buckets(Manifest.of(weights), mib << 20).buckets)
            # Per engine: begin, receive, finish (verify off here).
            rows.append((f"bucketed broadcast, {mib} MiB buckets", 3, buckets, seconds))
        per_parameter()  # warm-up
        per_param_s = median_time(per_parameter, args.repeats)
        rows.append(("one call per parameter (OpenRLHF)", len(weights), len(weights), per_param_s))
        sender.config = SyncConfig(
            bucket_bytes=args.bucket_mib[0] << 20, timeout_s=120, verify=True
        )
        verified = sender.sync(weights, next_version())
        status = raise_first_error(call_engines(engines, "weight_status"))
        assert all(s.version == version[0] and not s.stale for s in status), status
    finally:
        destroy_engines(engines)
        ray.shutdown()
        folder.cleanup()

    best_bucketed = min(r[3] for r in rows if r[0].startswith("bucketed"))
    logger.info("")
    logger.info(
        "Weight sync on CPU (gloo), %d engine(s), model %d layers x %d hidden: %d tensors, %.1f MB",
        args.engines,
        args.layers,
        args.hidden,
        len(weights),
        nbytes / 1e6,
    )
    logger.info(
        "Machine: %s, %d logical CPUs, %s, Python %s, torch %s, ray %s",
        cpu_name(),
        os.cpu_count(),
        platform.platform(),
        platform.python_version(),
        torch.__version__,
        ray.__version__,
    )
    logger.info("Median of %d runs (memcpy: of %d).", args.repeats, max(args.repeats, 5))
    logger.info("")
    header = (
        f"| {'method':<38} | {'RPCs/engine':>11} | {'collectives':>11} | {'seconds':>8} "
        f"| {'GB/s':>6} | {'vs memcpy':>9} |"
    )
    logger.info(header)
    logger.info(
        "|%s|%s:|%s:|%s:|%s:|%s:|", "-" * 40, "-" * 12, "-" * 12, "-" * 9, "-" * 7, "-" * 10
    )
    for name, rpcs, collectives, seconds in rows:
        logger.info(
            "| %-38s | %11d | %11d | %8.4f | %6.3f | %8.1fx |",
            name,
            rpcs,
            collectives,
            seconds,
            nbytes / seconds / 1e9,
            seconds / memcpy_s,
        )
    logger.info("")
    logger.info("one call per parameter / best bucketed: %.1fx slower", per_param_s / best_bucketed)
    logger.info(
        "bucketed sync with checksum verification: %.4f s (verify phase %.4f s)",
        verified.seconds,
        verified.phases.get("verify", 0.0),
    )


if __name__ == "__main__":
    main()
