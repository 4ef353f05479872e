"""An on-policy run with a warm spare (`spare_engines=1`): an engine killed
during iteration 1 is replaced by the spare, which is woken and synced to the
policy's current weights before it serves; the run completes exactly once.
Colocated (`colocate`): the engines, the spare and the policy share one
bundle, the policy started once the engines and the spare are up. Spares on
bundles of their own: tests/engines/lifecycle/test_spares.py, and the GPU suite."""

from __future__ import annotations

import ray
from rollout_support import kill_during_iteration, nothing_left, rows_by_prompt
from test_on_policy_flow import engine_rows, killable_run

from flows.rollout import rollout
from tasks.run.shards import read_rows


def test_killed_engine_is_replaced_by_the_synced_spare(ray_local, tiny_model, tmp_path):
    killed: list[str] = []
    killer = kill_during_iteration(tmp_path, 1, 1, killed)
    params = killable_run(tiny_model, tmp_path, spare_engines=1, colocate=True)
    state = rollout(params, return_state=True)
    killer.join(timeout=5)
    assert state.is_completed(), state.message
    assert killed, "the engine was not killed during iteration 1"
    summary = state.result()
    run_dir = tmp_path / summary.run_id
    prefix = killed[0].rsplit("-", 1)[0]
    spare = f"{prefix}-2"  # the spare: named past the two engines

    # Exactly once: every (prompt, sample) of each iteration, no duplicate.
    for iteration in (0, 1):
        rows = read_rows(run_dir / f"iter-{iteration:03d}")
        assert len(rows_by_prompt(rows)) == len(rows) == 32 * 8
    rows = read_rows(run_dir / "iter-001")
    # The spare served part of iteration 1, with the weights of version 1 only.
    assert {row["weight_version"] for row in rows} == {1}
    assert spare in {row["engine"] for row in rows}

    table = {row["name"]: row for row in engine_rows(state)}
    assert killed[0] not in table  # its slot now shows the spare
    assert table[spare]["replaced_by"] == "spare" and table[spare]["restarts"] == 1
    assert 0 < table[spare]["replacement_s"] < 60
    # One bundle held the engines, the spares and the policy.
    (group,) = [
        info for info in ray.util.placement_group_table().values() if summary.run_id in info["name"]
    ]
    assert group["bundles"] == {0: {"CPU": 1.0}}
    nothing_left(summary.run_id)  # engines, the spares (old and new), group, policy
