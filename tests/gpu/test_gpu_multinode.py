"""The flow on two Ray nodes of one host, each its own `ray start` process
with one GPU: the head on GPU 0, a worker on GPU 1 whose working directory
and PYTHONPATH hold the bundle's packages (vLLM, Ray) but not rolloutflow.
The CLI joins with `--address`, ships its code through the job's runtime_env,
and one of its two engines runs on the worker. Nodes are ended by their
process group ids (`cluster_support`), never `ray stop`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.run.shards import read_rows

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
# cluster_support lives with the CPU cluster tests (no test package to import it from).
sys.path.insert(0, str(ROOT / "tests" / "flows"))
from cluster_support import ProcessCluster  # noqa: E402

PROMPTS = ROOT / "data" / "prompts.jsonl"
WORKER = "gpu-worker"
#: A driver without rolloutflow: can the worker import it, which node is the
#: worker, and where did the run's actors (named rf-<run id>-...) live.
PROBE = f"""
import json, sys, ray
ray.init(address=sys.argv[1])

@ray.remote(num_cpus=0, resources={{"{WORKER}": 0.01}})
def import_engines():
    try:
        import engines
    except ImportError as exc:
        return f"ImportError: {{exc}}"
    return engines.__file__

found = ray.get(import_engines.remote(), timeout=120)
worker = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "{WORKER}" in n["Resources"]]
actors = [
    {{"name": a["Name"], "node": a["Address"]["NodeID"]}}
    for a in ray._private.state.actors().values()
    if a["Name"].startswith(sys.argv[2])
]
print(json.dumps({{"import": found, "worker": worker, "actors": actors}}))
"""


def without_repo(path: str) -> str:
    """PYTHONPATH minus the checkout (the bundle's /tmp/site stays)."""
    kept = [p for p in path.split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return os.pathsep.join(kept)


@pytest.fixture
def two_nodes(gpu_count):
    if gpu_count < 2:
        pytest.skip("one node per GPU: needs two GPUs")
    site = without_repo(os.environ.get("PYTHONPATH", ""))
    nodes = ProcessCluster(python=Path(sys.executable), pythonpath=site)
    try:
        nodes.start_head(num_cpus=4, num_gpus=1, env={"CUDA_VISIBLE_DEVICES": "0"})
        nodes.add_worker(WORKER, 4, {WORKER: 1}, num_gpus=1, env={"CUDA_VISIBLE_DEVICES": "1"})
        yield nodes
    finally:
        nodes.shutdown()


def probe(nodes: ProcessCluster, prefix: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, nodes.address, prefix],
        cwd=nodes.root,
        env=nodes.env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_flow_runs_an_engine_on_a_second_node_without_rolloutflow(two_nodes, gpu_model, tmp_path):
    nodes = two_nodes
    before = probe(nodes, "rf-none-")
    assert before["import"] == "ImportError: No module named 'engines'", before
    (worker,) = before["worker"]

    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "flows.cli",
        "--plain",
        "--backend", "vllm",
        "--model", gpu_model,
        "--prompts-path", str(PROMPTS),
        "--address", nodes.address,
        "--num-engines", "2",  # one GPU per node: one engine on each
        "--max-len", "1024",
        "--max-tokens", "32",
        "--gpu-memory-utilization", "0.3",
        "--engine-kwargs", '{"enforce_eager": true}',  # start-up in seconds, not a minute
        "--shard-size", "4",
        "--ready-timeout-s", "240",
        "--output-format", "jsonl",
        "--output-dir", str(out),
    ]  # fmt: skip
    # The driver imports the checkout; its working directory is not the
    # repository (Ray puts the driver's directory on its workers' path).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (nodes.pythonpath, str(ROOT)) if p),
        PREFECT_HOME=str(tmp_path / "prefect"),
        RAY_AUTH_MODE="disabled",
    )
    proc = subprocess.run(cmd, cwd=nodes.root, env=env, capture_output=True, text=True, timeout=360)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]

    (run_dir,) = out.iterdir()
    prompts = PROMPTS.read_text().splitlines()
    rows = [row for iteration in sorted(run_dir.glob("iter-*")) for row in read_rows(iteration)]
    assert len(rows) == len(prompts)
    assert len({row["engine"] for row in rows}) == 2  # both engines served
    after = probe(nodes, f"rf-{run_dir.name}-")
    on_worker = [a["name"] for a in after["actors"] if a["node"] == worker]
    print(f"multinode: actors {after['actors']}; on the worker node: {on_worker}")
    assert on_worker, after
