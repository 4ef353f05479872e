"""Dynamic sampling through the rollout flow (real Ray, real CPU engines, the
policy): groups whose rewards all agree are written marked `filtered`, their
prompts sampled again in refill rounds with seeds of their own, and the
policy trains on the groups with signal."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollout_support import nothing_left, run_params, small_run
from test_on_policy_flow import LETTER_TASK
from waiting import wait_until

from flows.rollout import rollout
from tasks.run.shards import read_rows

#: Round 0 of each prompt scores flat (no signal); every later sample of it
#: scores its sample index's parity: the refill round has signal. The scorer
#: is one actor per run, so the module's state lives through the run.
FLAT_THEN_SIGNAL = """
SEEN = set()

def reward(samples):
    first = {s.id for s in samples} - SEEN
    SEEN.update(s.id for s in samples)
    return [0.5 if s.id in first else float(s.sample % 2) for s in samples]
"""
FLAT = """
def reward(samples):
    return [1.0] * len(samples)
"""


def reward_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "reward_under_test.py"
    path.write_text(text)
    return f"{path}:reward"


def run_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read() -> list[str]:
        async with get_client() as client:
            found = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            )
        return [log.message for log in found]

    return asyncio.run(read())


def check_written_once(run_dir: Path, report) -> list[dict]:
    """Every row of the iteration on disk once: (prompt, sample, round) unique."""
    rows = read_rows(run_dir / f"iter-{report.iteration:03d}")
    keys = [(r["prompt_index"], r["sample_index"], r["refill_round"]) for r in rows]
    assert len(keys) == len(set(keys)) == report.rows, report
    return rows


def test_refill_rounds_fill_the_batch_with_groups_with_signal(ray_local, tiny_model, tmp_path):
    params = run_params(
        **small_run(tiny_model, tmp_path / "out"),
        reward=reward_file(tmp_path, FLAT_THEN_SIGNAL),
        dynamic_sampling=True,
        iterations=1,
    )
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    (report,) = summary.iterations
    prompts = 32
    # Round 0: every group flat, filtered; round 1 refills all of them, with signal.
    assert (report.groups, report.filtered_groups, report.refill_rounds) == (64, 32, 1)
    rows = check_written_once(tmp_path / "out" / summary.run_id, report)
    by_round = {r: [row for row in rows if row["refill_round"] == r] for r in (0, 1)}
    assert all(row["filtered"] for row in by_round[0])
    assert not any(row["filtered"] for row in by_round[1])
    assert len({row["seed"] for row in rows}) == 2 * prompts  # a seed per request
    (step,) = summary.training
    assert step.samples == step.trained_samples == prompts * 2  # the refill's groups
    assert summary.metrics[0].filtered_fraction == 0.5
    nothing_left(summary.run_id)


def test_refill_stops_at_its_bound_naming_it(ray_local, tiny_model, tmp_path):
    params = run_params(
        **small_run(tiny_model, tmp_path / "out"),
        reward=reward_file(tmp_path, FLAT),
        dynamic_sampling=True,
        max_refill_rounds=1,
        iterations=1,
    )
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    (report,) = summary.iterations
    assert (report.groups, report.filtered_groups, report.refill_rounds) == (64, 64, 1)
    check_written_once(tmp_path / "out" / summary.run_id, report)
    # No group has signal: the step runs on the iteration's own rows, learns nothing.
    (step,) = summary.training
    assert (step.samples, step.trained_samples) == (64, 0)
    assert summary.metrics[0].filtered_fraction == 1.0
    flow_run_id = state.state_details.flow_run_id
    wait_until(
        lambda: any(
            "max_refill_rounds=1 with 0 of 32 groups with learning signal" in message
            for message in run_logs(flow_run_id)
        ),
        60,
        "the warning naming max_refill_rounds",
    )
    nothing_left(summary.run_id)


def test_letter_task_with_dynamic_sampling_trains_on_groups_with_signal(
    ray_local, tiny_model, tmp_path
):
    params = run_params(**{**small_run(tiny_model, tmp_path), **LETTER_TASK}, dynamic_sampling=True)
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    run_dir = tmp_path / summary.run_id
    refilled = 0
    for report, step in zip(summary.iterations, summary.training, strict=True):
        rows = check_written_once(run_dir, report)
        kept = {(r["prompt_index"], r["refill_round"]) for r in rows if not r["filtered"]}
        first = {key for key in kept if key[1] == 0}
        print(report, step, len(first), len(kept))
        # The step learns from every group it is given: all have signal.
        assert step.samples == len(kept) * 8 and step.trained_samples > 0, (report, step)
        assert len(kept) == 16 or report.refill_rounds == 3, report
        refilled += len(kept) - len(first)
    # Refill rounds found groups with signal beyond the iterations' own.
    assert refilled > 0
