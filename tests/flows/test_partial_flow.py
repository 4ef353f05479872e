"""The `partial` schedule through the rollout flow, on the long-tail workload
(tiny model, CPU, real Ray, engines and policy): each step trains on the
first groups to complete; the others are aborted at the sync and resumed
under the new weights. Every (group, sample) is written once, each token's
version is within the wait bound, and no group started is dropped. Which
samples get resumed depends on timing (the CPU engine's static batches);
tests/tasks/partial/test_partial_runner.py resumes them deterministically."""

from __future__ import annotations

import json

import pytest
from rollout_support import nothing_left, run_params, small_run

from flows.rollout import rollout
from tasks.partial.task import CarryStore, group_seed, in_flight_groups
from tasks.run.shards import read_rows
from training.long_tail import make_rows

ITERATIONS, WAIT, PROMPTS, N = 4, 2, 8, 2


@pytest.mark.parametrize("start_next", [False, True], ids=["held", "start-next"])
def test_partial_rollouts_resume_across_syncs_and_write_each_sample_once(
    ray_local, tiny_model, tmp_path, start_next, monkeypatch
):
    rows = make_rows(PROMPTS, seed=3, scale=32)  # 2-16 tokens, one row of 256
    prompts = tmp_path / "long_tail.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = run_params(
        **small_run(
            tiny_model,
            tmp_path / "out",
            prompts_path=str(prompts),
            id_field="id",
            label_field="answer",
            reward="training.rewards:target_chars_fraction",
            schedule="partial",
            max_staleness=WAIT,
            iterations=ITERATIONS,
            n=N,
            max_len=320,
            ignore_eos=True,
            learning_rate=0.01,
            partial_start_next=start_next,
        )
    )
    read_back = []
    load = CarryStore.load
    monkeypatch.setattr(CarryStore, "load", lambda self, i: read_back.append(i) or load(self, i))
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert [step.weight_version for step in summary.training] == [1, 2, 3, 4]
    # Every sync found groups left running beside the step (the long row's),
    # and its stop is reported with the iteration that left them; the next
    # iteration took that carry from the stop, not from the file.
    assert all(step.stop_seconds is not None for step in summary.training)
    assert read_back == [-1], read_back
    run_dir = tmp_path / "out" / summary.run_id
    written, all_rows = {}, []
    for i in range(ITERATIONS):
        batch = read_rows(run_dir / f"iter-{i:03d}")
        all_rows += batch
        assert sorted(r["prompt_index"] for r in batch) == sorted(list(range(PROMPTS)) * N)
        for row in batch:
            key = (row["seed"], row["sample_index"])
            assert key not in written, f"{key} written in iterations {written[key]} and {i}"
            written[key] = i
            versions = row["token_versions"]
            assert len(versions) == len(row["response_token_ids"]) == row["max_tokens"]
            assert versions == sorted(versions) and i - WAIT <= versions[0] <= versions[-1] <= i
            # Every version a segment ran under (one that made no token too).
            assert set(versions) <= set(row["weight_versions"]) and row["weight_versions"][-1] <= i
            assert row["weight_version"] == row["weight_versions"][0] >= i - WAIT
            assert len(row["logprobs"]) == len(versions)
    # None dropped: every group started is written or still carried, once.
    # An iteration's new groups fill its slots up to in_flight beside the
    # older groups carried to it (some of them started beside the step before).
    carry = CarryStore(run_dir)
    in_flight, seed = in_flight_groups(PROMPTS, 1.5), params.sampling.seed
    started = {
        group_seed(seed, j, slot, in_flight)
        for j in range(ITERATIONS)
        for slot in range(in_flight - sum(g.origin < j for g in carry.load(j - 1)))
    }
    # Rows of groups started beside the step before their iteration (origin
    # j: seed // in_flight), first sampled by version j - 1; the checks above
    # held for them too (every token within the wait bound of its row).
    early = [r for r in all_rows if r["weight_version"] < (r["seed"] - seed) // in_flight]
    assert bool(early) == start_next, len(early)
    carried = {g.seed for g in carry.load(ITERATIONS - 1)}
    assert all(g.origin > ITERATIONS - 1 - WAIT for g in carry.load(ITERATIONS - 1))
    assert {r["seed"] for r in all_rows} | carried == started
    assert not {r["seed"] for r in all_rows} & carried
    nothing_left(summary.run_id)
