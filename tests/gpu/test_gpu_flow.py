"""The rollout flow end to end on GPUs: its CLI with the vLLM backend, joined
to the test session's Ray cluster (the way a flow joins a running cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_helpers import wait_gpus_released

from engines.trajectory import NOT_SAMPLED
from tasks.run.shards import read_rows

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
# The tool task's parameters live with the CPU agent test (no test package to import from).
sys.path.insert(0, str(ROOT / "tests" / "flows"))
from test_agent_flow import TOOL_TASK  # noqa: E402

ITERATIONS = 2


def run_flow_cli(ray, model: str, tmp_path, *args: str, timeout_s: float) -> str:
    """`python -m flows.cli` with the vLLM backend on the test's Ray cluster
    and its own Prefect home; returns stdout (asserts a clean exit)."""
    cmd = [
        sys.executable, "-m", "flows.cli",
        "--plain",  # RolloutParams' defaults under the flags, not the CLI's demo preset
        "--backend", "vllm",
        "--model", model,
        "--max-len", "2048",
        "--gpu-memory-utilization", "0.3",
        "--output-dir", str(tmp_path / "out"),
        "--address", ray.get_runtime_context().gcs_address,
        "--ready-timeout-s", "300",
        "--output-format", "jsonl",  # the tests below read JSONL; a later flag wins
        *args,
    ]  # fmt: skip
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_flow_cli_with_the_vllm_backend(ray_gpu, gpu_model, gpu_count, gpu_baseline, tmp_path):
    ray = ray_gpu
    prompts = (ROOT / "data" / "prompts.jsonl").read_text().splitlines()
    num_engines = min(2, gpu_count)
    stdout = run_flow_cli(
        ray,
        gpu_model,
        tmp_path,
        "--num-engines", str(num_engines),
        "--max-tokens", "48",
        "--logprobs", "0",
        "--iterations", str(ITERATIONS),
        "--shard-size", "4",  # 8 shards an iteration: every engine gets some
        timeout_s=480,
    )  # fmt: skip
    expected = len(prompts) * ITERATIONS
    assert f"{expected} rollouts written to" in stdout

    (run_dir,) = (tmp_path / "out").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rows"] == expected
    rows = [row for iteration in sorted(run_dir.glob("iter-*")) for row in read_rows(iteration)]
    assert len(rows) == expected
    engines = {row["engine"] for row in rows}
    assert len(engines) == num_engines  # the work was spread over every engine
    for row in rows:
        assert row["response_token_ids"] and len(row["logprobs"]) == len(row["response_token_ids"])
        assert row["weight_version"] == 0 and row["finish_reason"] in ("stop", "length")
    print(f"flow: {expected} rows from engines {sorted(engines)} in {summary['seconds']}s")
    wait_gpus_released(gpu_baseline)


def test_on_policy_flow_syncs_over_nccl(ray_gpu, gpu_model, gpu_count, gpu_baseline, tmp_path):
    """The on-policy loop on GPUs: one vLLM engine, the policy on the other GPU
    (NCCL broadcast after every GRPO step); iteration i samples version i."""
    if gpu_count < 2:
        pytest.skip("the policy takes a GPU of its own: needs two GPUs")
    ray = ray_gpu
    iterations = 3
    run_flow_cli(
        ray,
        gpu_model,
        tmp_path,
        "--num-engines", "1",
        "--reward", "training.rewards:target_chars_fraction",
        "--learning-rate", "0.001",
        "--n", "8",
        "--max-tokens", "16",
        "--iterations", str(iterations),
        timeout_s=540,
    )  # fmt: skip

    (run_dir,) = (tmp_path / "out").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    training = summary["training"]
    print(f"on-policy flow: training table {training}; {summary['seconds']}s")
    assert [step["weight_version"] for step in training] == list(range(1, iterations + 1))
    for i in range(iterations):
        rows = read_rows(run_dir / f"iter-{i:03d}")
        assert rows and {row["weight_version"] for row in rows} == {i}
    wait_gpus_released(gpu_baseline)


def test_the_tool_task_learns_colocated_on_one_gpu(ray_gpu, gpu_baseline, tmp_path):
    """`make run-agent` on one GPU: the tool task's agent through the vLLM
    engine's OpenAI endpoint and the run's router, the policy colocated
    (CUDA IPC sync after every step); the reward rises, and iteration i's rows
    hold the sessions' turns, masks and version i on every sampled token.
    The model and lengths are the CPU test's (`make run-agent`'s tiny model):
    the task and its learning rate are sized for it. vLLM serves its float32
    checkpoint in bf16, and the policy sends bf16 (in float32, vLLM's Triton
    attention faulted on its 16-wide heads)."""
    from engines.tiny_model import build_tiny_model

    model = str(build_tiny_model(tmp_path / "tiny"))
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in TOOL_TASK.items()]
    run_flow_cli(
        ray_gpu, model, tmp_path, "--colocate", "--num-engines", "1",
        "--max-len", "128", "--max-tokens", "8", "--engine-kwargs", '{"enforce_eager": true}',
        *flags, timeout_s=300,
    )  # fmt: skip

    (run_dir,) = (tmp_path / "out").iterdir()
    training = json.loads((run_dir / "summary.json").read_text())["training"]
    rewards = [step["mean_reward"] for step in training]
    print(f"tool task colocated on one GPU: rewards {rewards}")
    assert rewards[-1] - rewards[0] > 0.15, rewards
    called = 0
    for i in range(TOOL_TASK["iterations"]):
        for row in read_rows(run_dir / f"iter-{i:03d}"):
            called += len(row["turns"]) >= 3
            for turn in row["turns"]:
                span = slice(turn["start"], turn["stop"])
                sampled = turn["role"] == "assistant"
                assert set(row["loss_mask"][span]) <= {int(sampled)}, (turn, row["loss_mask"])
                assert set(row["token_versions"][span]) <= {i if sampled else NOT_SAMPLED}
    assert called, "no session called the tool and answered in one sample"
    wait_gpus_released(gpu_baseline)
