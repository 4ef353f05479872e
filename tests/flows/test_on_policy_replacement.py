"""An on-policy run whose engine is lost during iteration 1 while a faster
way than a new actor waits for it: a warm spare (`spare_engines=1`), woken,
or a prepared actor (`prepared_actors=1`), which starts the lost engine. The
replacement is synced to the policy's current weights before it serves; the
run completes exactly once and leaves nothing behind. Colocated
(`colocate`): the engines, the spare or the prepared actor and the policy
share one bundle, the policy started once the engines (and the spare) are
up. Spares on bundles of their own and the prepared actor alone:
tests/engines/lifecycle/test_spares.py, test_prepared.py, and the GPU suite."""

from __future__ import annotations

import pytest
import ray
from rollout_support import kill_during_iteration, nothing_left, rows_by_prompt
from test_on_policy_flow import engine_rows, killable_run

from flows.rollout import rollout
from tasks.run.shards import read_rows


@pytest.mark.parametrize(
    ("way", "setting"), [("spare", "spare_engines"), ("prepared", "prepared_actors")]
)
def test_killed_engine_is_replaced_and_synced(way, setting, ray_local, tiny_model, tmp_path):
    killed: list[str] = []
    killer = kill_during_iteration(tmp_path, 1, 1, killed)
    params = killable_run(tiny_model, tmp_path, **{setting: 1}, colocate=True)
    state = rollout(params, return_state=True)
    killer.join(timeout=5)
    assert state.is_completed(), state.message
    assert killed, "the engine was not killed during iteration 1"
    summary = state.result()
    run_dir = tmp_path / summary.run_id
    prefix = killed[0].rsplit("-", 1)[0]
    successor = f"{prefix}-2"  # the spare or the prepared actor: named past the two engines

    # Exactly once: every (prompt, sample) of each iteration, no duplicate.
    for iteration in (0, 1):
        rows = read_rows(run_dir / f"iter-{iteration:03d}")
        assert len(rows_by_prompt(rows)) == len(rows) == 32 * 8
    rows = read_rows(run_dir / "iter-001")
    # The successor served part of iteration 1, with the weights of version 1 only.
    assert {row["weight_version"] for row in rows} == {1}
    assert successor in {row["engine"] for row in rows}

    table = {row["name"]: row for row in engine_rows(state)}
    assert killed[0] not in table  # its slot now shows the successor
    assert table[successor]["replaced_by"] == way and table[successor]["restarts"] == 1
    assert 0 < table[successor]["replacement_s"] < 60
    # One bundle held the engines, the spare or prepared actor, and the policy.
    (group,) = [
        info for info in ray.util.placement_group_table().values() if summary.run_id in info["name"]
    ]
    assert group["bundles"] == {0: {"CPU": 1.0}}
    nothing_left(summary.run_id)  # engines, their successors (used and new), group, policy
