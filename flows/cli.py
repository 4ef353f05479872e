"""Run the rollout flow from the command line.

    rolloutflow                                  # the demo: a few on-policy iterations
    rolloutflow --plain                          # a plain rollout job (RolloutParams' defaults)
    rolloutflow --config run.yaml --num-engines 4
    rolloutflow --help                           # every parameter, with its bounds

Parameters come from the demo preset (unless --plain), then a config file
(YAML or JSON, in `RolloutParams`' sections: `engines: {num_engines: 4}`),
then flags (flows/arguments.py). They are checked before anything starts.
Without PREFECT_API_URL the run uses a local Prefect server that the CLI
starts and that ends with it.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import sys
import time
from typing import TYPE_CHECKING

from flows.settings import prefect_ui_hint, set_local_prefect_defaults

set_local_prefect_defaults()  # before Prefect is imported (flows.rollout below)

from engines.env import (  # noqa: E402
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_STARTUP_TIMEOUT,
    RAY_ADDRESS,
)
from flows import lifetime  # noqa: E402
from flows.arguments import parse_params  # noqa: E402
from flows.params import RolloutParams  # noqa: E402

if TYPE_CHECKING:  # imports Prefect, which must first see PREFECT_API_URL (main)
    from tasks.engines import EarlyEngines

STOPPED_EXIT = {"SIGTERM": 143, "SIGINT": 130}  # 128 + the signal, as a shell reports it


def start_ray(params: RolloutParams) -> bool:
    """Start the run's local Ray, or connect to its cluster, here in the main
    thread, so that the CLI owns the signal handling and ends the connection;
    the flow then uses this connection (on a cluster, with the job's
    runtime_env that ships the run's code). True: a local Ray started here."""
    lifetime.quiet_ray_signal_handlers()
    from tasks.cluster import local_num_cpus
    from tasks.run.connection import connect

    cpus = local_num_cpus(params.cluster, params.engines, params.on_policy)
    started = connect(params.cluster.address, cpus, "rolloutflow-cli", params.cluster.runtime_env)
    if started:
        lifetime.reap_on_death(lifetime.descendants(os.getpid()))
    return started


def checked_model(params: RolloutParams) -> str | None:
    """The run's model directory if its input passes the flow's own checks
    (sampling fields, reward, logger, every prompt), else None: engines
    start early only for such a run, so that a run failing on its input
    still fails before anything is created. Runs beside `ray.init`."""
    from flows.rollout import check_settings
    from tasks.engines import model_path
    from tasks.run.prompts import read_run_prompts

    try:
        model = model_path(params.engines.model)
        check_settings(params)
        read_run_prompts(params.data, model)
    except Exception:  # noqa: BLE001 - the flow fails on the same, with the run's context
        return None
    return model


def start_engines_early(params: RolloutParams, model: str) -> EarlyEngines | None:
    """Start the run's engines now, on the local Ray started here, beside the
    Prefect server's start. Their own start (a Ray worker importing torch and
    transformers, then the model load) otherwise began only after the
    server's and the flow's, on the way to the first row. They are passed
    to the flow, whose `create_engines` takes them, its spec being the
    same (docs/history/benchmarks-diary.md)."""
    import ray

    from engines import EngineSpecError, check_cluster_fits, resolve_backend
    from flows.rollout import engine_set
    from tasks.engines import start_early

    engines = params.engines
    try:
        backend = resolve_backend(engines.backend)
        check_cluster_fits(
            1 if params.training.colocate else engines.num_engines + engines.spare_engines,
            engines.tensor_parallel_size,
            uses_gpu=ray.cluster_resources().get("GPU", 0) > 0,
        )
        return start_early(engine_set(params, model, backend))
    except EngineSpecError:
        return None  # the flow fails on the same, with the run's context


def startup_line(
    params: RolloutParams,
    server: lifetime.LocalPrefect | None,
    ready_s: float,
    ray_here: bool,
    ray_s: float,
) -> str:
    """Where the run's Prefect and Ray are (and, for the benchmark, when they came up)."""
    prefect = (
        f"local server at {server.api_url} (loopback only; ends with this command)"
        if server is not None
        else os.environ[PREFECT_API_URL]
    )
    cluster = (
        f"local, started here in {ray_s:.1f} s (no dashboard)"
        if ray_here
        else f"the cluster at {params.cluster.address or os.environ.get(RAY_ADDRESS)} "
        "(its dashboard: port 8265 of its head unless set otherwise)"
    )
    return f"Prefect API: {prefect}, ready after {ready_s:.1f} s\nRay: {cluster}"


def print_results(summary) -> None:
    """What the user sees at the end of a run (kept in one place)."""
    for row in summary.training:
        mismatch = "" if row.logprob_mismatch is None else f", mismatch {row.logprob_mismatch:.4f}"
        synced = (
            f"; synced v{row.weight_version} ({row.sync_bytes / 1e6:.1f} MB in "
            f"{row.sync_seconds:.3f} s)"
            if row.weight_version is not None
            else ""
        )
        # partial: the stop of what ran beside the step, on the sync's path.
        stopped = (
            ""
            if row.stop_seconds is None
            else f"; left running stopped in {row.stop_seconds:.3f} s"
        )
        print(
            f"iteration {row.iteration}: mean reward {row.mean_reward:.3f}; generate "
            f"{row.generate_seconds:.1f} s, train {row.train_seconds:.1f} s; idle: engines "
            f"{row.engine_idle_seconds:.1f} s, policy {row.policy_idle_seconds:.1f} s; "
            f"staleness {row.staleness_max}{mismatch}{stopped}{synced}"
        )
    print(f"\n{summary.rows} rollouts written to {summary.output_dir}")
    if summary.curves:
        from tasks.run.report import terminal_curves

        print("\n" + "\n".join(terminal_curves(summary.metrics)))
        print(f"curves: {summary.curves}")


def cores_to_spare() -> bool:
    """Whether the Prefect server should start beside Ray. Its start is mostly
    imports on one core, and Ray's leaves the others idle much of the time:
    together they came up sooner on a quiet 2-core box. On a loaded one, Ray
    beside the server took twice as long, and its raylet came near (at load
    15 and more, missed) its fixed 30 s registration deadline
    (docs/history/benchmarks-diary.md), so there Ray starts first, alone."""
    return os.getloadavg()[0] < (os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    params = parse_params(argv)
    began = time.monotonic()
    signals = lifetime.StopSignals()
    signals.install()
    server: lifetime.LocalPrefect | None = None
    ray_here = False
    in_run = False
    early = None
    try:
        # The server's URL is known before it runs, and before Prefect is
        # imported here, which reads it once.
        if not os.environ.get(PREFECT_API_URL):
            server = lifetime.LocalPrefect()
            os.environ[PREFECT_API_URL] = server.api_url
            if cores_to_spare():
                server.start()
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            checked = executor.submit(checked_model, params)
            ray_here = start_ray(params)
            model = checked.result()
        ray_s = time.monotonic() - began
        signals.install()  # ray.init took SIGTERM
        signals.check()
        if ray_here and model is not None:
            early = start_engines_early(params, model)
        if server is not None:
            server.start()  # a no-op when it started beside Ray
        from flows.rollout import rollout

        if server is not None:
            server.wait_ready(float(os.environ[PREFECT_STARTUP_TIMEOUT]))
        print(startup_line(params, server, time.monotonic() - began, ray_here, ray_s), flush=True)
        signals.check()
        in_run = True
        summary = signals.run(lambda: run_flow(rollout, params, early, local=server is not None))
    except lifetime.Stopped as exc:
        stopped_by = exc.signal_name
    except Exception as exc:  # noqa: BLE001 - the run's log above holds the traceback
        print(f"\nerror: the rollout run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    else:
        stopped_by = None
    finally:
        if server is not None:
            if handlers := sys.modules.get("prefect.logging.handlers"):
                # The run's last log lines reach the server before it stops;
                # sent later, Prefect prints "Error logging to API" after ours.
                handlers.APILogWorker.drain_all(timeout=5)
            server.terminate()  # it stops while Ray does
        import ray

        ray.shutdown()  # a no-op unless connected
        if server is not None:
            server.stop()
    if stopped_by:
        what = ["the run (Crashed, its engines torn down)" if in_run else "the start-up"]
        what += ["the local Ray"] * ray_here + ["the local Prefect server"] * (server is not None)
        print(f"\n{stopped_by}: stopped {', '.join(what)}", file=sys.stderr)
        return STOPPED_EXIT[stopped_by]
    print_results(summary)
    print(prefect_ui_hint(os.environ[PREFECT_HOME], summary.run_id, local=server is not None))
    # The process ends next: its last garbage collection would walk every
    # object of Prefect, Ray and pyarrow for about a second on a small box.
    gc.freeze()
    return 0


def run_flow(rollout, params: RolloutParams, early: EarlyEngines | None, local: bool):
    """The flow; on the CLI's own server without flow run heartbeats: they
    let a long-lived server mark a crashed run, this one ends with the run,
    and the flow's end waits up to a second for the heartbeat thread."""
    if not local:
        return rollout(params, early)
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return rollout(params, early)


if __name__ == "__main__":
    sys.exit(main())
