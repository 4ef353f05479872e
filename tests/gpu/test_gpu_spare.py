"""A warm spare on GPUs (issue 16): an on-policy run with `spare_engines=1`
whose engine is killed during iteration 1; the spare is woken and synced to
the policy's current weights before it serves, and the run completes exactly
once. On one GPU the engine, its sleeping spare and the policy share it
(`colocate`, CUDA IPC sync); on three each has its own (NCCL sync). On two, a
rollout job (no policy) checks the spare's life cycle on real vLLM. On one, a
rollout job without a spare whose engine core is killed: the engine restarts
in its actor; and one whose engine actor is killed: a prepared actor starts
the engine in its place."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from gpu_helpers import READY_TIMEOUT_S, kill_engine_core, wait_gpus_released

from tasks.run.shards import read_rows

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 32
N = 8


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def rows_of(run_dir: Path, iteration: int) -> list[dict]:
    return read_rows(run_dir / f"iter-{iteration:03d}")


def run_killing_engine_0(
    ray, out: Path, iteration: int, spares: int = 1, core_only: bool = False, **settings
):
    """A run with one engine and `spares` warm spares whose engine is killed
    once `iteration` wrote its first shard: its actor, or (`core_only`) only
    vLLM's engine-core process, by SIGKILL. Returns (state, the engine's name)."""
    from flows.params import RolloutParams, sectioned
    from flows.rollout import rollout

    killed: list[str] = []

    def kill():
        deadline = time.monotonic() + 400
        pattern = f"*/iter-{iteration:03d}/shard-*"
        while (shard := next(out.glob(pattern), None)) is None:
            assert time.monotonic() < deadline, f"iteration {iteration} never began"
            time.sleep(0.05)
        namespace = f"rolloutflow-{shard.parents[1].name}"
        names = sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].endswith("-0")
        )
        handle = ray.get_actor(names[-1], namespace=namespace)
        if core_only:
            kill_engine_core(handle)
        else:
            ray.kill(handle, no_restart=True)
        killed.append(names[-1])

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    fields = dict(
        prompts_path=str(ROOT / "data" / "prompts.jsonl"),
        backend="vllm",
        output_dir=str(out),
        output_format="jsonl",
        num_engines=1,
        spare_engines=spares,
        max_len=1024,
        gpu_memory_utilization=0.3,
        engine_kwargs={"enforce_eager": True},
        n=N,
        max_tokens=512,
        ignore_eos=True,  # long enough to be killed mid-iteration
        shard_size=1,
        shards_per_engine=4,
        ready_timeout_s=READY_TIMEOUT_S,
        **settings,
    )
    params = RolloutParams.model_validate(sectioned(fields))
    state = rollout(params, return_state=True)
    killer.join(timeout=5)
    assert state.is_completed(), state.message
    assert killed, f"the engine was not killed during iteration {iteration}"
    return state, killed[0]


def engine_row(state, name: str, replaced_by: str, within_s: float) -> dict:
    """Engine `name`'s row of the run's engine table (a Prefect artifact),
    replaced once, by `replaced_by`, serving again within `within_s`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from tasks.run.artifacts import ENGINES_KEY

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    (table,) = [a for a in artifacts if a.key == ENGINES_KEY]
    data = table.data if isinstance(table.data, list) else json.loads(table.data)
    row = {r["name"]: r for r in data}[name]
    assert row["replaced_by"] == replaced_by and row["restarts"] == 1, row
    assert 0 < row["replacement_s"] < within_s, row
    return row


@pytest.mark.parametrize("colocate", [True, False], ids=["one-gpu-colocated", "three-gpus"])
def test_killed_engine_is_replaced_by_the_synced_spare(
    ray_gpu, gpu_model, gpu_count, gpu_baseline, prefect_harness, tmp_path, colocate
):
    if not colocate and gpu_count < 3:
        pytest.skip("engine, spare and policy take a GPU each: needs three GPUs")
    began = time.monotonic()
    state, killed = run_killing_engine_0(
        ray_gpu,
        tmp_path / "out",
        1,
        model=gpu_model,
        reward="training.rewards:target_chars_fraction",
        learning_rate=0.001,
        iterations=2,
        colocate=colocate,
    )
    run_dir = Path(state.result().output_dir)
    spare = killed.rsplit("-", 1)[0] + "-1"
    for iteration in (0, 1):  # exactly once: each (prompt, sample) one row
        rows = rows_of(run_dir, iteration)
        keys = {(row["prompt_index"], row["sample_index"]) for row in rows}
        assert len(rows) == len(keys) == PROMPTS * N
    rows = rows_of(run_dir, 1)
    assert {row["weight_version"] for row in rows} == {1}
    by_spare = [row for row in rows if row["engine"] == spare]
    assert by_spare, "the spare served nothing"
    row = engine_row(state, spare, "spare", 30)
    print(
        f"\nspare {spare} served {len(by_spare)} rows of iteration 1; replacement "
        f"{row['replacement_s']}s (woken + synced, {'CUDA IPC' if colocate else 'NCCL'}); "
        f"run {time.monotonic() - began:.0f}s"
    )
    wait_gpus_released(gpu_baseline)


def test_killed_engine_is_replaced_by_the_spare_in_a_rollout_job(
    ray_gpu, gpu_model, gpu_count, gpu_baseline, prefect_harness, tmp_path
):
    """Two GPUs, no policy: the spare's life cycle on real vLLM (asleep on its
    own GPU, woken when the engine dies, serving the rest exactly once)."""
    if gpu_count < 2:
        pytest.skip("the engine and its spare take a GPU each: needs two GPUs")
    state, killed = run_killing_engine_0(ray_gpu, tmp_path / "out", 0, model=gpu_model)
    run_dir = Path(state.result().output_dir)
    spare = killed.rsplit("-", 1)[0] + "-1"
    rows = rows_of(run_dir, 0)
    keys = {(row["prompt_index"], row["sample_index"]) for row in rows}
    assert len(rows) == len(keys) == PROMPTS * N
    by_spare = [row for row in rows if row["engine"] == spare]
    assert by_spare, "the spare served nothing"
    row = engine_row(state, spare, "spare", 30)
    print(f"\nspare {spare} served {len(by_spare)} rows; replacement {row['replacement_s']}s")
    wait_gpus_released(gpu_baseline)


def test_engine_whose_core_died_restarts_in_its_actor_in_a_rollout_job(
    ray_gpu, gpu_model, gpu_baseline, prefect_harness, tmp_path
):
    """One GPU, no spare: vLLM's engine core is killed mid-run under its live
    actor; the engine starts again in that actor and the run writes every
    rollout exactly once."""
    state, engine = run_killing_engine_0(
        ray_gpu, tmp_path / "out", 0, spares=0, core_only=True, model=gpu_model
    )
    rows = rows_of(Path(state.result().output_dir), 0)
    keys = {(row["prompt_index"], row["sample_index"]) for row in rows}
    assert len(rows) == len(keys) == PROMPTS * N
    row = engine_row(state, engine, "restart", READY_TIMEOUT_S)
    print(f"\nengine {engine} restarted in its actor, serving again after {row['replacement_s']}s")
    wait_gpus_released(gpu_baseline)


def test_lost_actor_is_replaced_by_the_prepared_actor_in_a_rollout_job(
    ray_gpu, gpu_model, gpu_baseline, prefect_harness, tmp_path
):
    """One GPU, no spare, a prepared actor: the engine's actor is killed
    mid-run (its engine core goes with it, freeing its memory a moment
    later); the prepared actor starts the engine on that GPU and the run
    writes every rollout exactly once."""
    state, killed = run_killing_engine_0(
        ray_gpu, tmp_path / "out", 0, spares=0, prepared_actors=1, model=gpu_model
    )
    rows = rows_of(Path(state.result().output_dir), 0)
    keys = {(row["prompt_index"], row["sample_index"]) for row in rows}
    assert len(rows) == len(keys) == PROMPTS * N
    adopter = killed.rsplit("-", 1)[0] + "-1"  # the prepared actor: named past the engine
    assert adopter in {row["engine"] for row in rows}
    row = engine_row(state, adopter, "prepared", READY_TIMEOUT_S)
    print(f"\n{adopter} took the lost {killed}'s place, serving after {row['replacement_s']}s")
    wait_gpus_released(gpu_baseline)
