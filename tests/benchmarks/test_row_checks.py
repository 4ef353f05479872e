"""The schedules benchmark's reading of what a run wrote
(benchmarks/row_checks.py): the reward of the rows an iteration's own
version sampled wholly, on rows written as the run writes them (JSONL shards)."""

from __future__ import annotations

import json

from benchmarks.row_checks import newest_version_reward


def write_iteration(run_dir, iteration: int, rows: list[dict]) -> None:
    directory = run_dir / f"iter-{iteration:03d}"
    directory.mkdir(parents=True)
    (directory / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_newest_reward_leaves_out_rows_begun_under_older_versions(tmp_path):
    write_iteration(
        tmp_path,
        5,
        [
            {"token_versions": [5, 5, 5], "reward": 0.9},
            {"token_versions": [5], "reward": 0.7},
            {"token_versions": [4, 4, 5], "reward": 0.1},  # carried from iteration 4
            {"token_versions": [3, 4, 5, 5], "reward": 0.2},
        ],
    )
    newest = newest_version_reward(tmp_path, 5)
    assert (newest.rows, newest.of) == (2, 4)
    assert abs(newest.reward - 0.8) < 1e-12


def test_no_row_wholly_of_the_newest_version_has_no_reward(tmp_path):
    write_iteration(tmp_path, 2, [{"token_versions": [1, 2], "reward": 0.5}])
    newest = newest_version_reward(tmp_path, 2)
    assert newest.reward is None and (newest.rows, newest.of) == (0, 1)
