"""Every environment variable the project reads or sets, in one place
(engines, flows and tasks alike).

Variables for engine actors are passed through Ray's `runtime_env`, never by
editing `os.environ` inside an actor.
"""

from __future__ import annotations

import os

# --- read by the project -----------------------------------------------------
#: Default deadline (seconds) of control calls into engines (health, sleep, ...).
RPC_TIMEOUT_S = "ROLLOUTFLOW_RPC_TIMEOUT_S"
#: Deadline (seconds) for an engine to come up (model load, CUDA graphs).
READY_TIMEOUT_S = "ROLLOUTFLOW_READY_TIMEOUT_S"
#: Where the tiny default model is built.
CACHE_DIR = "ROLLOUTFLOW_CACHE_DIR"
#: torch threads per CPU engine actor (1: more threads thrash small machines).
TORCH_THREADS = "ROLLOUTFLOW_TORCH_THREADS"

# --- read by the flow layer (flows/, tasks/) -----------------------------------
#: Ray's own: the cluster to connect to when no address is given.
RAY_ADDRESS = "RAY_ADDRESS"
#: Prefect's home (profiles, local database). The CLI points it at the
#: repository's `.prefect-home` unless set: the default `~/.prefect` is shared
#: by every project of the user.
PREFECT_HOME = "PREFECT_HOME"
#: Prefect's API; when set, the CLI leaves PREFECT_HOME alone (a real server).
PREFECT_API_URL = "PREFECT_API_URL"
#: Off: analytics writes to the local SQLite database and causes
#: "database is locked" noise.
PREFECT_SERVER_ANALYTICS_ENABLED = "PREFECT_SERVER_ANALYTICS_ENABLED"
#: How long a run waits for its ephemeral Prefect server (Prefect's default:
#: 20 s). The CLI raises it to 120 s: a first start on a fresh machine
#: (database migrations, block registration) ran past 20 s on an H200 host.
PREFECT_STARTUP_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"

# --- set for engine actors (runtime_env) --------------------------------------
#: vLLM's Ray executor: which bundles of the engine's placement group to use.
VLLM_RAY_BUNDLE_INDICES = "VLLM_RAY_BUNDLE_INDICES"
#: vLLM's Ray executor: GPU fraction per worker when engines share GPUs.
VLLM_RAY_PER_WORKER_GPUS = "VLLM_RAY_PER_WORKER_GPUS"
#: What OpenRLHF sets in its engine actors for `full_determinism` ("0").
VLLM_ENABLE_V1_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def get_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r} must be positive")
    return value


def rpc_timeout_s() -> float:
    return get_float(RPC_TIMEOUT_S, 60.0)


def ready_timeout_s() -> float:
    return get_float(READY_TIMEOUT_S, 600.0)


def torch_threads() -> int:
    return int(get_float(TORCH_THREADS, 1))


def actor_env_vars(
    backend: str, bundle_indices: list[int], gpu_fraction: float | None, node_cpus: int
) -> dict:
    """The environment of one engine actor on a node with `node_cpus` CPUs."""
    if backend != "vllm":
        return {
            "OMP_NUM_THREADS": str(torch_threads()),
            "TOKENIZERS_PARALLELISM": "false",
            TORCH_THREADS: str(torch_threads()),
        }
    # OpenMP's default, as plain vLLM runs: every core of the node. Ray would
    # set 1 in an actor (ray/_private/utils.py, set_omp_num_threads_if_unset),
    # which slowed vLLM's start: plain vLLM with OMP_NUM_THREADS=1 took 80.3 s
    # cold against 62.8 s (issue 34, one H200).
    env = {"OMP_NUM_THREADS": str(node_cpus)}
    if len(bundle_indices) > 1:
        # Only vLLM's Ray executor (TP>1) reads it. vLLM hashes every VLLM_*
        # variable it knows into its torch.compile cache key
        # (`compile_factors` in vllm/envs.py, v0.26.0), so set for TP=1 it
        # gave each engine (each bundle) a compile cache of its own: cold for
        # every engine of a set, and for a spare on another bundle.
        env[VLLM_RAY_BUNDLE_INDICES] = ",".join(map(str, bundle_indices))
        if gpu_fraction is not None:
            env[VLLM_RAY_PER_WORKER_GPUS] = str(gpu_fraction)
    # AsyncLLM talks to its engine-core process in msgpack, which refuses
    # tensors' metadata, CUDA-IPC handles and functions in collective_rpc
    # unless pickle is allowed (vllm/v1/serial_utils.py, v0.26.0:
    # https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/v1/serial_utils.py).
    # The socket is local to the engine; its child process inherits this.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # vLLM's own start-up deadline, aligned with ours.
    env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(ready_timeout_s()))
    return env
