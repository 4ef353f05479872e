"""Failure hooks of the rollout flow: sweep the run's engines by name.

They run for `on_failure`, `on_crashed` and `on_cancellation`, and may run
in another process than the flow (a worker runs `on_cancellation`, and
`on_crashed` after a SIGKILL, out of process, without the flow's objects).
So they rely on nothing but the flow run: its id names the engines, its
parameters name the cluster. They are idempotent, and they never raise: a
hook's error would only hide the run's own.
"""

from __future__ import annotations

import os

import ray
from prefect.logging.loggers import flow_run_logger

from engines.env import RAY_ADDRESS
from tasks.run.scope import sweep_run


def cluster_address(parameters: dict) -> str | None:
    params = parameters.get("params") or {}
    if not isinstance(params, dict):  # an in-process run passes the model itself
        params = params.model_dump()
    return (params.get("cluster") or {}).get("address") or os.environ.get(RAY_ADDRESS)


def sweep_engines(flow, flow_run, state) -> None:
    logger = flow_run_logger(flow_run, flow)
    connected_here = False
    try:
        if not ray.is_initialized():
            address = cluster_address(flow_run.parameters)
            if not address:
                # The run started a local Ray: it ended with the run (teardown,
                # or the flow process's exit), taking the engines with it.
                logger.info("nothing to sweep: the run's local Ray ended with the run")
                return
            ray.init(address=address, log_to_driver=False)
            connected_here = True
        swept = sweep_run(str(flow_run.id))
        logger.info(
            "%s: swept the run's engines%s",
            state.name,
            f" (left by {swept})" if swept else ", none were left",
        )
    except Exception:  # noqa: BLE001 - see the module docstring
        logger.exception("sweeping the run's engines failed")
    finally:
        if connected_here:
            ray.shutdown()
