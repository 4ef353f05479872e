"""SIGTERM to the flow process mid-run: afterwards no actor and no placement
group of the run remains on the cluster (which this test owns and inspects
through Ray), and Prefect records the run as crashed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import ray
from prefect.client.orchestration import get_client
from rollout_support import REPO, long_run, nothing_left, run_dirs, wait_until, written_shards


def cli_args(params: dict) -> list[str]:
    args = []
    for name, value in params.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args


def test_sigterm_mid_run_leaves_nothing(ray_local, tiny_model, tmp_path, prefect_api_url):
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    log = (tmp_path / "flow.log").open("w")
    flow = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *cli_args(long_run(tiny_model, tmp_path, address))],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: written_shards(tmp_path) or flow.poll() is not None, 180, "a shard")
        assert flow.poll() is None, (tmp_path / "flow.log").read_text()[-3000:]
        (run_dir,) = run_dirs(tmp_path)
        run_id = run_dir.name
        assert ray.util.list_named_actors(all_namespaces=True), "engines should be running"
        flow.send_signal(signal.SIGTERM)
        flow.wait(timeout=120)
    finally:
        if flow.poll() is None:
            flow.kill()
        log.close()

    assert len(written_shards(tmp_path)) < 32, "the run finished before the signal"
    nothing_left(run_id)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(uuid.UUID(run_id)).state
    assert state.is_crashed(), state
