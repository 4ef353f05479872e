"""The rollout flow on a real multi-node Ray cluster whose nodes cannot
import rolloutflow (`cluster_support`): the run ships its code through the
job's runtime_env, engines run on the worker nodes, a worker node that dies
mid-generation is survived with every rollout written once, the policy's
node dying fails the run naming the policy with nothing left, and on a cluster
with token authentication the run works with the token and a driver without
it is refused."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import ray
from cluster_support import ProcessCluster, can_hide_folders
from rollout_support import (
    NUM_PROMPTS,
    REPO,
    long_run,
    nothing_left,
    rows_by_prompt,
    run_dirs,
    run_params,
    small_run,
    written_shards,
)
from waiting import wait_until

from engines.errors import EngineDeadError
from flows.rollout import rollout
from tasks.run.shards import read_rows

pytestmark = pytest.mark.slow
#: A reward that makes a run on-policy (a policy trains between iterations).
REWARD = "training.rewards:target_chars_fraction"


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs (nothing of the run lands there) and two workers
    of two CPUs each, tagged with a custom resource of their own name; where
    the nodes can have mount namespaces, a folder of the driver's that they
    do not see (`hidden`)."""
    ray.shutdown()  # the session's local Ray, if an earlier test started it
    hidden = [Path(tempfile.mkdtemp(prefix="rf-driver-only-"))] if can_hide_folders() else []
    nodes = ProcessCluster(hidden=hidden)
    try:
        nodes.start_head(num_cpus=0)
        nodes.add_worker("w1", 2, {"w1": 1})
        nodes.add_worker("w2", 2, {"w2": 1})
        ray.init(address=nodes.address)
        nodes.wait_for_nodes()
        ray.shutdown()
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        for folder in hidden:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def driver(cluster, monkeypatch):
    """The test process as a driver of the cluster, outside the repository:
    Ray puts the driver's working directory on its workers' path."""
    monkeypatch.chdir(cluster.root)
    ray.shutdown()
    yield cluster
    ray.shutdown()


@ray.remote(num_cpus=1)
def import_engines() -> str:
    try:
        import engines
    except ImportError as exc:
        return f"ImportError: {exc}"
    return engines.__file__


@ray.remote(num_cpus=0)
def file_seen(path: str) -> bool:
    return os.path.exists(path)


#: A `file.py:function` agent: the tool task's, from a file of the driver's.
FILE_AGENT = """from agents.tool_task import agent as tool_task_agent


async def agent(client, row):
    return await tool_task_agent(client, row)
"""


def run_actors(run_id: str) -> list[dict]:
    """The run's actors as GCS recorded them, dead ones included."""
    return [
        actor
        for actor in ray._private.state.actors().values()
        if actor["Name"].startswith(f"rf-{run_id}-")
    ]


def assert_every_rollout_once(output_dir, run_id: str) -> None:
    rows = rows_by_prompt(read_rows(output_dir / run_id / "iter-000"))
    assert sorted(rows) == [(p, s) for p in range(NUM_PROMPTS) for s in range(2)]


def test_nodes_cannot_import_rolloutflow_without_the_runtime_env(driver):
    ray.init(address=driver.address)
    for node in ("w1", "w2"):
        answer = ray.get(import_engines.options(resources={node: 0.01}).remote(), timeout=120)
        assert answer == "ImportError: No module named 'engines'", (node, answer)


def test_flow_ships_its_code_and_runs_engines_on_the_workers(driver, tiny_model, tmp_path):
    state = rollout(
        run_params(**small_run(tiny_model, tmp_path, address=driver.address)),
        return_state=True,
    )
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    assert_every_rollout_once(tmp_path, run_id)

    # The run left this process connected to the cluster (it did not start it).
    engines = run_actors(run_id)
    assert len(engines) == 2
    workers = {driver.nodes["w1"].node_id, driver.nodes["w2"].node_id}
    assert {actor["Address"]["NodeID"] for actor in engines} <= workers
    assert all(actor["State"] == "DEAD" for actor in engines)
    nothing_left(run_id)


def test_a_file_agent_runs_on_nodes_without_its_file(driver, tiny_model, tmp_path):
    """`--agent file.py:function` where only the driver has the file: the
    runners on the worker nodes run the source the driver read (the path
    alone failed there: no file)."""
    if not driver.hidden:
        pytest.skip("the nodes cannot get mount namespaces of their own here (needs root)")
    path = driver.hidden[0] / "my_file_agent.py"
    path.write_text(FILE_AGENT)
    ray.init(address=driver.address)
    for node in ("w1", "w2"):  # the file is the driver's only
        seen = file_seen.options(resources={node: 0.01}).remote(str(path))
        assert ray.get(seen, timeout=120) is False, node
    ray.shutdown()
    tool_task = {
        "prompts_path": str(REPO / "data" / "tool_task.jsonl"),
        "label_field": "answer",
        "id_field": "id",
        "agent": f"{path}:agent",
        "train": False,
    }
    params = small_run(tiny_model, tmp_path, address=driver.address, **tool_task)
    state = rollout(run_params(**params), return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    rows = read_rows(tmp_path / run_id / "iter-000")
    # A session the router split writes a row per piece: each (prompt, sample) at least once.
    samples = {(row["prompt_index"], row["sample_index"]) for row in rows}
    assert samples == {(p, s) for p in range(16) for s in range(2)}
    assert all(row["session_id"] for row in rows)
    nothing_left(run_id)


def test_worker_node_lost_mid_generation(driver, tiny_model, tmp_path):
    """Kill the node that holds the engines (both: the placement group packs
    them) while shards are being written: Ray re-places the engines' bundles
    on the other worker, the retry replaces the engines there, and the run
    completes with every rollout once and nothing left."""
    killed: list[str] = []

    def kill_engines_node():
        # The engines' node is looked up before their first shard, so the
        # kill follows it at once. With 40 tokens a sample the whole
        # generation took about 1.5 s on an idle box and ended before the
        # kill reached the engines: the run needs long_run's length.
        (run_dir,) = wait_until(lambda: run_dirs(tmp_path), 240, "the run's directory")
        alive = wait_until(
            lambda: [a for a in run_actors(run_dir.name) if a["State"] == "ALIVE"],
            240,
            "the run's engines",
        )
        (node_id,) = {actor["Address"]["NodeID"] for actor in alive}
        (name,) = [n for n, node in driver.nodes.items() if node.node_id == node_id]
        wait_until(lambda: written_shards(tmp_path), 240, "the first shard")
        driver.kill(name)
        killed.append(name)

    # Connected first, so the killer can look at the actors; the run keeps
    # this connection (and ships no code: the test does it here).
    from tasks.run.connection import code_runtime_env

    ray.init(address=driver.address, runtime_env=code_runtime_env())
    killer = threading.Thread(target=kill_engines_node, daemon=True)
    killer.start()
    state = rollout(
        run_params(**long_run(tiny_model, tmp_path, address=driver.address)),
        return_state=True,
    )
    killer.join(timeout=30)
    assert state.is_completed(), state.message
    assert len(killed) == 1
    run_id = str(state.state_details.flow_run_id)
    assert_every_rollout_once(tmp_path, run_id)
    survivor = driver.nodes["w2" if killed == ["w1"] else "w1"].node_id
    replacements = [a for a in run_actors(run_id) if a["Address"]["NodeID"] == survivor]
    assert len(replacements) == 2
    nothing_left(run_id)


def test_policy_node_lost_fails_the_run_and_sweeps_it(driver, tiny_model, tmp_path):
    """An on-policy run whose policy is on a node of its own: one worker's two
    CPUs hold the engines, a one-CPU "trainer" node is the only room left for
    the policy. That node dies mid-generation: the run fails with an error
    naming the policy, and nothing of the run is left on the cluster."""
    from tasks.run.connection import code_runtime_env

    ray.init(address=driver.address, runtime_env=code_runtime_env())
    # One engine worker (the node-loss test above leaves one; alone, this ends one).
    for name in [n for n in ("w1", "w2") if not driver.nodes[n].killed][1:]:
        driver.kill(name)
    driver.add_worker("trainer", 1, {"trainer": 1})
    driver.wait_for_nodes()
    trainer_node = driver.nodes["trainer"].node_id
    killed: list[str] = []

    def kill_policy_node():
        wait_until(lambda: written_shards(tmp_path), 240, "the first shard")
        (run_dir,) = run_dirs(tmp_path)
        alive = [a for a in run_actors(run_dir.name) if a["State"] == "ALIVE"]
        on_trainer = [a["ActorClassName"] for a in alive if a["Address"]["NodeID"] == trainer_node]
        killed.extend(on_trainer)
        if "ReferencePolicy" in on_trainer:  # else the test fails below, nothing killed
            driver.kill("trainer")

    killer = threading.Thread(target=kill_policy_node, daemon=True)
    killer.start()
    params = long_run(
        tiny_model, tmp_path, address=driver.address, max_tokens=16, iterations=2, reward=REWARD
    )
    state = rollout(run_params(**params), return_state=True)
    killer.join(timeout=30)
    assert "ReferencePolicy" in killed, killed
    assert state.is_failed(), state.message
    error = state.result(raise_on_failure=False)
    if "RewardScorer" in killed:
        # The reward actor takes no CPU, so Ray may place it on that node too;
        # then whichever of the two the run calls first names the failure.
        assert isinstance(error, EngineDeadError | ray.exceptions.RayActorError), repr(error)
    else:
        assert isinstance(error, EngineDeadError) and error.engine == "policy", repr(error)
    nothing_left(str(state.state_details.flow_run_id))


@pytest.fixture(scope="module")
def token_cluster():
    """One node with CPUs for the engines, token authentication on. Ray reads
    RAY_AUTH_MODE once per process, so its drivers are subprocesses."""
    nodes = ProcessCluster(token=secrets.token_hex(16))
    try:
        nodes.start_head(num_cpus=2)
        yield nodes
    finally:
        nodes.shutdown()


def driver_env(token: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {})
    return {**env, **extra}


def test_token_authentication(token_cluster, tiny_model, tmp_path, prefect_api_url):
    """The CLI run, given the token the way Ray documents (RAY_AUTH_TOKEN),
    ships its code, runs its engines and completes; a driver with a wrong
    token, or none, cannot even connect."""
    params = small_run(tiny_model, tmp_path, address=token_cluster.address)
    # --plain: a rollout job on these parameters, without the CLI's demo preset.
    flags = ["--plain"] + [f"--{k.replace('_', '-')}={v}" for k, v in params.items()]
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *flags],
        cwd=token_cluster.root,  # not the repository: Ray puts it on the workers' path
        env=driver_env(token_cluster.token, PYTHONPATH=str(REPO), PREFECT_API_URL=prefect_api_url),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert_every_rollout_once(tmp_path, run_dir.name)

    probe = "import ray, sys; ray.init(address=sys.argv[1]); print('connected')"
    for token in ("0" * 32, None):
        refused = subprocess.run(
            [sys.executable, "-c", probe, token_cluster.address],
            cwd=token_cluster.root,
            env=driver_env(token, RAY_AUTH_MODE="token" if token else "disabled"),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert refused.returncode != 0 and "connected" not in refused.stdout
        assert "Authentication token is missing or incorrect" in refused.stderr
