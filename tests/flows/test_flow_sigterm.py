"""SIGTERM or SIGKILL to the CLI mid-run, on a cluster of its own: afterwards
no actor and no placement group of the run remains on the cluster (which this
test owns and inspects through Ray). After SIGTERM, Prefect records the run as
crashed and the CLI exits with 143 after one line saying what it stopped (no
stack dump); after SIGKILL, Ray removes what the dead CLI owned."""

from __future__ import annotations

import signal
import uuid

import pytest
import ray
from cli_support import cli_args, cli_env, start_cli, stop, wait_for_a_shard
from prefect.client.orchestration import get_client
from rollout_support import long_run, nothing_left, run_dirs, written_shards


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopped_run_leaves_nothing_on_the_cluster(
    signum, ray_local, tiny_model, tmp_path, prefect_api_url
):
    address = ray.get_runtime_context().gcs_address
    log_path = tmp_path / "flow.log"
    params = long_run(tiny_model, tmp_path, address)
    cli = start_cli(cli_args(params), cli_env(PREFECT_API_URL=prefect_api_url), log_path)
    try:
        wait_for_a_shard(cli, tmp_path, log_path)
        (run_dir,) = run_dirs(tmp_path)
        run_id = run_dir.name
        assert ray.util.list_named_actors(all_namespaces=True), "engines should be running"
    finally:
        returncode = stop(cli, signum)

    assert len(written_shards(tmp_path)) < 32, "the run finished before the signal"
    nothing_left(run_id, timeout_s=90)  # after SIGKILL Ray must notice the dead driver
    if signum == signal.SIGKILL:
        assert returncode == -signal.SIGKILL
        return
    output = (tmp_path / "flow.log").read_text()
    assert returncode == 143, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("SIGTERM: stopped the run (Crashed")
    assert "SIGTERM received" not in output and "Traceback" not in output, output[-3000:]
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(uuid.UUID(run_id)).state
    assert state.is_crashed(), state
