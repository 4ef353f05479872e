"""End to end through a real Prefect server: `prefect deploy` from
prefect.yaml, `prefect deployment run`, a process worker; runs that
complete, are cancelled through the API, fail and are retried like the UI's
"Retry" button, and a second run that waits for the first (the deployment's
concurrency limit). The runs connect to the Ray cluster this test owns, so
what they leave behind is checked through Ray.

Workers start in an empty directory: each run gets the code from the pull
step, a clone of this checkout's committed HEAD (`rolloutflow_repository`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import State, StateType
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling
from rollout_support import (
    NUM_PROMPTS,
    REPO,
    kill_engine,
    long_run,
    nothing_left,
    rows_by_prompt,
    small_run,
    written_shards,
)
from waiting import wait_until

from flows.params import sectioned
from tasks.run.shards import read_rows

pytestmark = pytest.mark.slow

PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "rolloutflow"  # the work pool named in prefect.yaml
DEPLOYMENT = "rollout/on-demand"


@dataclass
class Server:
    url: str
    env: dict[str, str]
    logs: Path

    @contextmanager
    def client(self) -> Iterator[SyncPrefectClient]:
        with temporary_settings({PREFECT_API_URL: self.url}):
            with get_client(sync_client=True) as client:
                yield client

    def state(self, run_id: str) -> State:
        with self.client() as client:
            return client.read_flow_run(uuid.UUID(run_id)).state

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [PREFECT, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120
        )
        if check and done.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    def run_deployment(self, params: dict) -> str:
        flow_params = json.dumps({"params": sectioned(params)})
        done = self.cli("deployment", "run", DEPLOYMENT, "--params", flow_params)
        return re.search(r"UUID: ([0-9a-f-]{36})", done.stdout).group(1)

    def start_worker(self, name: str, *, run_once: bool = True) -> subprocess.Popen:
        """A worker in an empty directory of its own (not the repository)."""
        log = (self.logs / f"worker-{name}.log").open("w")
        workdir = self.logs / f"worker-{name}"
        workdir.mkdir()
        return subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", POOL] + (["--run-once"] if run_once else []),
            cwd=workdir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def stop_worker(self, worker: subprocess.Popen) -> None:
        """SIGTERM, then SIGKILL if the worker is still shutting down after a
        minute (a loaded box): a worker left running would take the next
        test's runs."""
        worker.terminate()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=30)

    def finish(self, worker: subprocess.Popen, run_id: str, name: str) -> State:
        try:
            worker.wait(timeout=180)
        finally:
            if worker.poll() is None:
                worker.kill()
        state = self.state(run_id)
        assert state.is_final(), (self.logs / f"worker-{name}.log").read_text()[-4000:]
        return state


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, ray_local_module) -> Iterator[Server]:
    """A real `prefect server start` on loopback with its own home and SQLite
    database, the process work pool, the variables prefect.yaml reads and
    both deployments."""
    home = tmp_path_factory.mktemp("prefect-server")
    url = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Workers notice cancellations sooner, and a run waiting for the
        # deployment's concurrency slot asks again sooner (default 30 s).
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_DEPLOYMENT_CONCURRENCY_SLOT_WAIT_SECONDS": "3",
    }
    port = url.split(":")[-1].split("/")[0]
    process = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port],
        env=env,
        stdout=(home / "server.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped as a whole below
    )
    try:
        wait_until(lambda: healthy(url) or process.poll() is not None, 300, "the Prefect server")
        assert process.poll() is None, (home / "server.log").read_text()[-3000:]
        running = Server(url, env, home)
        running.cli("work-pool", "create", POOL, "--type", "process")
        running.cli("variable", "set", "rolloutflow_repository", str(REPO))
        ray_address = ray_local_module.get_runtime_context().gcs_address
        running.cli("variable", "set", "ray_address", ray_address)
        running.cli("--no-prompt", "deploy", "--all")
        yield running
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def address(ray_local) -> str:
    return ray.get_runtime_context().gcs_address


def test_deployments_from_prefect_yaml(server):
    with server.client() as client:
        nightly = client.read_deployment_by_name("rollout/nightly")
        on_demand = client.read_deployment_by_name(DEPLOYMENT)
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
    assert on_demand.schedules == []
    assert nightly.enforce_parameter_schema and on_demand.enforce_parameter_schema
    assert on_demand.work_pool_name == POOL
    for deployment in (nightly, on_demand):
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
        # Resolved by `prefect deploy` from the Prefect variable.
        address = ray.get_runtime_context().gcs_address
        assert deployment.job_variables["env"]["RAY_ADDRESS"] == address
        assert [list(step) for step in deployment.pull_steps] == [
            ["prefect.deployments.steps.git_clone"],
            ["prefect.deployments.steps.set_working_directory"],
        ]
    assert nightly.parameters["params"]["engines"]["num_engines"] == 8


def test_invalid_parameters_are_rejected_by_the_server(server):
    invalid = '{"params": {"engines": {"num_engines": 0}}}'
    done = server.cli("deployment", "run", DEPLOYMENT, "--params", invalid, check=False)
    assert "params.engines.num_engines" in done.stdout + done.stderr
    assert "Created flow run" not in done.stdout


def test_parameters_of_the_flat_shape_are_rejected_by_the_server(server):
    flat = '{"params": {"num_engines": 4}}'
    done = server.cli("deployment", "run", DEPLOYMENT, "--params", flat, check=False)
    assert "num_engines" in done.stdout + done.stderr
    assert "Created flow run" not in done.stdout


def test_deployment_run_completes(server, address, tiny_model, tmp_path):
    """No `address` parameter: the run finds Ray through RAY_ADDRESS, set by
    the work pool's job variables; the code comes from the pull step."""
    run_id = server.run_deployment(small_run(tiny_model, tmp_path))
    state = server.finish(server.start_worker("complete"), run_id, "complete")
    assert state.is_completed(), state
    rows = rows_by_prompt(read_rows(tmp_path / run_id / "iter-000"))
    assert sorted(rows) == [(p, s) for p in range(NUM_PROMPTS) for s in range(2)]
    with server.client() as client:
        assert client.read_flow_run(uuid.UUID(run_id)).name == "tiny-llama-x2-1it"
    # The process worker runs each flow run in a temporary directory of its
    # own, empty: the entrypoint (flows/rollout.py) was there only because
    # the pull step cloned the repository into it.
    nothing_left(run_id)


def test_second_run_waits_for_the_first(server, address, tiny_model, tmp_path):
    """The deployment's concurrency limit (1, ENQUEUE): a run submitted while
    another runs waits for its slot, then runs; neither fails. Both are
    submitted before the worker starts, so one waits whichever it takes first."""
    first = server.run_deployment(small_run(tiny_model, tmp_path / "first", address))
    second = server.run_deployment(small_run(tiny_model, tmp_path / "second", address))
    worker = server.start_worker("queue", run_once=False)
    try:
        wait_until(lambda: server.state(first).is_final(), 300, "the first run")
        wait_until(lambda: server.state(second).is_final(), 300, "the second run")
    finally:
        server.stop_worker(worker)
    with server.client() as client:
        runs = [client.read_flow_run(uuid.UUID(r)) for r in (first, second)]
        states = {r.id: [s.name for s in client.read_flow_run_states(r.id)] for r in runs}
    assert all(run.state.is_completed() for run in runs), runs
    # The worker may have picked either up first; the other waited.
    earlier, later = sorted(runs, key=lambda run: run.start_time)
    assert "AwaitingConcurrencySlot" in states[later.id], states
    assert later.start_time >= earlier.end_time
    nothing_left(first)
    nothing_left(second)


def test_cancelled_through_the_api_leaves_nothing(server, address, tiny_model, tmp_path):
    run_id = server.run_deployment(long_run(tiny_model, tmp_path, address, max_tokens=200))
    worker = server.start_worker("cancel")
    wait_until(lambda: written_shards(tmp_path) or worker.poll() is not None, 180, "a shard")
    with server.client() as client:
        client.set_flow_run_state(uuid.UUID(run_id), Cancelling())
    state = server.finish(worker, run_id, "cancel")
    assert state.is_cancelled(), state
    assert len(written_shards(tmp_path)) < NUM_PROMPTS, "the run finished before the cancel"
    nothing_left(run_id)


def test_retry_of_a_failed_run_reuses_its_shards(server, address, tiny_model, tmp_path):
    # No task retries: the killed engine fails the run, as when retries run out.
    params = long_run(tiny_model, tmp_path, address, engine_retries=0)
    run_id = server.run_deployment(params)
    worker = server.start_worker("fail")
    wait_until(lambda: written_shards(tmp_path) or worker.poll() is not None, 180, "a shard")
    kill_engine(run_id, 1)
    state = server.finish(worker, run_id, "fail")
    assert state.is_failed(), state
    first_attempt = len(written_shards(tmp_path))
    assert 0 < first_attempt < NUM_PROMPTS
    nothing_left(run_id)

    # What the UI's "Retry" button does: same flow run, rescheduled.
    with server.client() as client:
        client.set_flow_run_state(
            uuid.UUID(run_id),
            State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"),
        )
    state = server.finish(server.start_worker("retry"), run_id, "retry")
    assert state.is_completed(), state

    summary = json.loads((tmp_path / run_id / "summary.json").read_text())
    assert summary["attempt"] == 2
    # One request per prompt (shard_size 1): only the missing shards ran.
    assert summary["generate_calls"] == NUM_PROMPTS - first_attempt
    rows = rows_by_prompt(read_rows(tmp_path / run_id / "iter-000"))
    assert sorted(rows) == [(p, s) for p in range(NUM_PROMPTS) for s in range(2)]
    nothing_left(run_id)
