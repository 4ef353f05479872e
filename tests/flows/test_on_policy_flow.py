"""The on-policy loop through the rollout flow: generate -> score -> GRPO step
-> weight sync -> generate, on the tiny model (CPU, gloo): the toy reward, and
the labelled letter task as the README runs it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import ray
from rollout_support import (
    REPO,
    kill_engine,
    nothing_left,
    rows_by_prompt,
    run_dirs,
    run_params,
    small_run,
    written_shards,
)
from test_rollout_flow import artifacts_of
from waiting import wait_until

from flows.params import RolloutParams
from flows.rollout import rollout
from tasks.run.artifacts import ENGINES_KEY
from tasks.run.shards import read_rows

REWARD = "training.rewards:target_chars_fraction"
#: docs/flow.md's on-policy example (its flags, as RolloutParams fields).
LETTER_TASK = {
    "prompts_path": str(REPO / "data" / "letter_task.jsonl"),
    "label_field": "answer",
    "id_field": "id",
    "reward": "training.letter_task:reward",
    "iterations": 6,
    "learning_rate": 0.02,
    "n": 8,
    "max_tokens": 4,
}


def on_policy_run(model, output_dir, **overrides) -> RolloutParams:
    settings = {
        "reward": REWARD,
        "learning_rate": 0.03,
        "n": 8,
        "max_tokens": 16,
        "shard_size": 16,
        **overrides,
    }
    return run_params(**small_run(model, output_dir, **settings))


def killable_run(model, output_dir, **overrides) -> RolloutParams:
    """Two iterations of one-prompt shards whose samples run to `max_tokens`:
    long enough for an engine to be killed while a generation is running."""
    settings = {
        "iterations": 2,
        "shard_size": 1,
        "shards_per_engine": 1,
        "max_len": 256,
        "max_tokens": 64,
        "ignore_eos": True,
        **overrides,
    }
    return on_policy_run(model, output_dir, **settings)


def engine_rows(state) -> list[dict]:
    """The run's engine table (artifact)."""
    tables = artifacts_of(state.state_details.flow_run_id)["table"]
    (engines,) = [t for t in tables if t.key == ENGINES_KEY]
    return engines.data if isinstance(engines.data, list) else json.loads(engines.data)


def versions(run_dir, iteration: int) -> set[int]:
    return {row["weight_version"] for row in read_rows(run_dir / f"iter-{iteration:03d}")}


def test_on_policy_flow_learns_and_serves_the_synced_weights(ray_local, tiny_model, tmp_path):
    state = rollout(on_policy_run(tiny_model, tmp_path, iterations=4), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    rewards = [step.mean_reward for step in summary.training]
    # Measured: 0.08 -> 0.08 -> 0.43 -> 0.88 with these seeds; a random policy
    # scores ~0.08. The bar needs a real learning signal, with room for drift.
    assert rewards[-1] - rewards[0] > 0.3, rewards
    assert [step.weight_version for step in summary.training] == [1, 2, 3, 4]
    run_dir = tmp_path / summary.run_id
    # Iteration i samples from the weights the policy had after i steps.
    assert [versions(run_dir, i) for i in range(4)] == [{0}, {1}, {2}, {3}]
    tables = artifacts_of(state.state_details.flow_run_id)["table"]
    training = [t for t in tables if t.key == "rollout-training"]
    assert len(training) == 1
    nothing_left(summary.run_id)  # engines, placement group and the policy actor


@ray.remote(num_cpus=0)
class CPUHolder:
    """Holds the CPUs it was created with (its `num_cpus` option) until killed."""

    def ready(self) -> bool:
        return True


def test_iteration_0_generates_while_the_policy_cannot_start(ray_local, tiny_model, tmp_path):
    """The policy starts beside the engines, and iteration 0's generation
    does not wait for it: every CPU but the engine's is held until
    iteration 0's rollouts are written, so the policy cannot start before."""
    # Every CPU free now but the engine's one: an earlier test's actor may
    # still hold one (fresh-clone CI of 7f9faa3 and a06300b: one stayed held
    # over 180 s; which test leaves it is not found yet).
    wait_until(lambda: ray.available_resources().get("CPU", 0) >= 1, 60, "a free CPU")
    holder = CPUHolder.options(num_cpus=ray.available_resources()["CPU"] - 1).remote()
    ray.get(holder.ready.remote(), timeout=60)
    released = threading.Event()

    def release_after_iteration_0():
        wait_until(lambda: written_shards(tmp_path, 0), 300, "a shard of iteration 0")
        released.set()
        ray.kill(holder)

    releaser = threading.Thread(target=release_after_iteration_0, daemon=True)
    releaser.start()
    try:
        params = on_policy_run(tiny_model, tmp_path, iterations=2, num_engines=1, shard_size=64)
        state = rollout(params, return_state=True)
    finally:
        ray.kill(holder)
    assert released.is_set()
    assert state.is_completed(), state.message
    summary = state.result()
    assert [step.weight_version for step in summary.training] == [1, 2]
    run_dir = tmp_path / summary.run_id
    assert [versions(run_dir, i) for i in range(2)] == [{0}, {1}]
    nothing_left(summary.run_id)


def run_killing_engine_1(
    params: RolloutParams, tmp_path, when: Callable[[Path], bool], actor: bool = True
):
    """Run the flow, killing engine 1 (its actor, or only its engine) once
    `when(run_dir)` holds; the run's final state."""

    def kill_during_iteration_1():
        wait_until(lambda: run_dirs(tmp_path), 120, "the run directory")
        (run_dir,) = run_dirs(tmp_path)
        wait_until(lambda: when(run_dir), 300, f"{when.__doc__} in {run_dir}")
        killed.append(kill_engine(run_dir.name, 1, actor))

    killed: list[str] = []
    killer = threading.Thread(target=kill_during_iteration_1, daemon=True)
    killer.start()
    state = rollout(params, return_state=True)
    killer.join(timeout=5)
    assert state.is_completed(), state.message
    assert killed, "the engine was not killed during iteration 1"
    return state


def test_restarted_engine_is_synced_before_it_generates(ray_local, tiny_model, tmp_path):
    """Engine 1's engine dies in iteration 1 under its live actor: it starts
    again in that actor, with the same handle, and gets the policy's current
    weights before any work (a sync that went by the handles alone would
    skip it): no row of iteration 1 comes from version 0. (A killed actor's
    new engine is synced the same way: the in-flight tests below.)"""

    params = killable_run(tiny_model, tmp_path)

    def iteration_1_begun(run_dir: Path) -> bool:
        """a shard of iteration 1"""
        return bool(list(run_dir.glob("iter-001/shard-*")))

    state = run_killing_engine_1(params, tmp_path, iteration_1_begun, actor=False)
    summary = state.result()
    run_dir = tmp_path / summary.run_id
    assert versions(run_dir, 0) == {0}
    assert versions(run_dir, 1) == {1}
    assert len(read_rows(run_dir / "iter-001")) == 32 * 8
    (row,) = [r for r in engine_rows(state) if r["restarts"]]
    assert row["replaced_by"] == "restart" and 0 < row["replacement_s"] < 120
    nothing_left(summary.run_id)


def test_letter_task_learns_and_rows_carry_reward_label_and_id(ray_local, tiny_model, tmp_path):
    import datasets
    import pandas

    params = run_params(
        **{**small_run(tiny_model, tmp_path), "output_format": "parquet", **LETTER_TASK}
    )
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    rewards = [step.mean_reward for step in summary.training]
    # Measured (python -m flows.cli, these settings): 0.005 -> 0.005 -> 0.18 ->
    # 0.44 -> 0.48 -> 0.49. A policy answering one letter always scores 0.5.
    assert rewards[-1] - rewards[0] > 0.25, rewards
    run_dir = tmp_path / summary.run_id
    frame = pandas.read_parquet(run_dir / "iter-000")
    source = pandas.read_json(LETTER_TASK["prompts_path"], lines=True).set_index("id")
    assert len(frame) == len(source) * 8
    assert (frame["label"] == source.loc[frame["id"], "answer"].to_numpy()).all()
    assert (frame["data_source"] == "letter_task").all()  # metadata travels too
    assert frame["prompt"].iloc[0].startswith("Last letter of ")
    assert frame["reward"].between(0, 1).all() and frame["advantage"].notna().all()
    every = datasets.load_dataset(
        "parquet",
        data_files=str(run_dir / "iter-*" / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert len(every) == len(frame) * LETTER_TASK["iterations"]
    assert sum(every["reward"]) / len(every) > rewards[0]
    assert all(step.reward_seconds >= 0 for step in summary.training)
    nothing_left(summary.run_id)


def staleness_of_rows(run_dir, iterations: int) -> dict[int, int]:
    """Per iteration i (trained at version i), the most its rows lag: i minus
    the oldest version a row was generated under."""
    return {
        i: i - min(min(row["weight_versions"]) for row in read_rows(run_dir / f"iter-{i:03d}"))
        for i in range(iterations)
    }


def test_overlap_learns_the_letter_task_within_the_staleness_bound(ray_local, tiny_model, tmp_path):
    params = run_params(**{**small_run(tiny_model, tmp_path), **LETTER_TASK}, schedule="overlap")
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    rewards = [step.mean_reward for step in summary.training]
    assert rewards[-1] - rewards[0] > 0.25, rewards
    run_dir = tmp_path / summary.run_id
    staleness = staleness_of_rows(run_dir, LETTER_TASK["iterations"])
    # Iteration i + 1 is generated while the policy trains on i: one version behind.
    assert staleness == {0: 0, **{i: 1 for i in range(1, LETTER_TASK["iterations"])}}
    assert [step.staleness_max for step in summary.training] == list(staleness.values())
    assert [step.weight_version for step in summary.training] == [1, 2, 3, 4, 5, 6]
    # Rows carry the engine's logprobs: the policy reports its mismatch with
    # them (over the samples it trained on): none on policy, some one version on.
    mismatch = [step.logprob_mismatch for step in summary.training]
    assert mismatch[0] < 0.01, mismatch
    assert any(m is not None and m > 0.01 for m in mismatch[1:]), mismatch
    for i in range(LETTER_TASK["iterations"]):
        assert len(rows_by_prompt(read_rows(run_dir / f"iter-{i:03d}"))) == 16 * 8
    nothing_left(summary.run_id)


def shard_times(run_dir: Path, iteration: int) -> list[float]:
    """When each written shard of `iteration` was written (its file's mtime)."""
    return sorted(path.stat().st_mtime for path in run_dir.glob(f"iter-{iteration:03d}/shard-*"))


def generated_side_by_side(run_dir: Path, first: int) -> bool:
    """Whether generations `first` and `first + 1` ran at once: a shard of
    the second was written before the last one of the first."""
    return shard_times(run_dir, first + 1)[0] < shard_times(run_dir, first)[-1]


def test_in_flight_with_an_engine_killed_writes_every_rollout_once(ray_local, tiny_model, tmp_path):
    """in_flight: generations 0 and 1 run at once on version 0 (the bound
    allows S + 1 = 2); generation 2 starts once version 1 is served, and
    version 2 is pushed while it runs. Engine 1 is killed in generation 2,
    after that push: the retry replaces it, syncs it to the policy's version,
    and every (prompt, sample) is written once, within the staleness bound."""

    params = killable_run(
        tiny_model, tmp_path, schedule="in_flight", iterations=3, n=2, max_tokens=48
    )

    def version_2_pushed_in_flight(run_dir: Path) -> bool:
        """a row of iteration 2 on version 2, with shards of it left"""
        if len(list(run_dir.glob("iter-002/shard-*.jsonl"))) >= 24:
            return False
        return any(2 in row["weight_versions"] for row in read_rows(run_dir / "iter-002"))

    state = run_killing_engine_1(params, tmp_path, version_2_pushed_in_flight)
    summary = state.result()
    run_dir = tmp_path / summary.run_id
    assert sum(row["restarts"] for row in engine_rows(state)) == 1  # replaced in iteration 2
    for i in range(3):
        assert len(rows_by_prompt(read_rows(run_dir / f"iter-{i:03d}"))) == 32 * 2
    assert staleness_of_rows(run_dir, 3) == {0: 0, 1: 1, 2: 1}
    assert summary.training[-1].weight_version == 3
    assert generated_side_by_side(run_dir, 0)
    assert summary.training[1].engine_idle_seconds == 0.0  # it started beside generation 0
    nothing_left(summary.run_id)


def test_in_flight_engine_killed_under_two_generations(ray_local, tiny_model, tmp_path):
    """Engine 1 dies while generations 0 and 1 both have work on it: one
    task's retry replaces it, the other's waits and finds it replaced (one
    restart), and every (prompt, sample) of both is written once."""
    params = killable_run(tiny_model, tmp_path, schedule="in_flight", n=2, max_tokens=48)

    def both_generating(run_dir: Path) -> bool:
        """a shard of iteration 1 written while iteration 0 still runs"""
        return len(shard_times(run_dir, 1)) > 0 and len(shard_times(run_dir, 0)) < 16

    state = run_killing_engine_1(params, tmp_path, both_generating)
    summary = state.result()
    run_dir = tmp_path / summary.run_id
    assert sum(s["restarts"] for s in engine_rows(state)) == 1
    for i in range(2):
        assert len(rows_by_prompt(read_rows(run_dir / f"iter-{i:03d}"))) == 32 * 2
    assert versions(run_dir, 0) == {0}
    assert staleness_of_rows(run_dir, 2)[1] <= 1
    nothing_left(summary.run_id)
