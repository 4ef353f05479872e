"""The schedules benchmark's reading of what a run wrote
(benchmarks/row_checks.py): the reward of the rows the newest version
sampled wholly, and another run's reward on the same prompts, on
rows written as the run writes them (JSONL shards)."""

from __future__ import annotations

import json

from benchmarks.row_checks import newest_version_reward, prompt_rewards, reward_on_prompts


def write_iteration(run_dir, iteration: int, rows: list[dict]) -> None:
    directory = run_dir / f"iter-{iteration:03d}"
    directory.mkdir(parents=True)
    (directory / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def row(prompt: str, versions: list[int], reward: float | None) -> dict:
    return {"prompt": prompt, "token_versions": versions, "reward": reward}


def test_the_newest_reward_leaves_out_rows_begun_under_older_versions(tmp_path):
    write_iteration(tmp_path, 4, [row("short a", [4, 4], 0.5), row("long", [3, 4], 0.0)])
    write_iteration(
        tmp_path,
        5,
        [
            row("short a", [5, 5, 5], 0.9),
            row("short b", [5], 0.7),
            row("long", [4, 4, 5], 0.1),  # carried from iteration 4
            row("long", [3, 4, 5, 5], 0.2),
        ],
    )
    for i in range(4):
        write_iteration(tmp_path, i, [row("short a", [i], 0.0)])
    newest = newest_version_reward(tmp_path, 6)
    assert (newest.version, newest.rows) == (5, 2)
    assert abs(newest.reward - 0.8) < 1e-12
    assert newest.prompts == ("short a", "short b")


def test_a_batch_begun_a_version_back_reads_that_version_over_both_batches(tmp_path):
    """partial_start_next: the last batch's groups all began beside the step
    before it, so version 1 is the newest that sampled rows wholly, in the
    last batch and in the one before."""
    write_iteration(tmp_path, 0, [row("p", [0], 0.1)])
    write_iteration(tmp_path, 1, [row("p", [0, 1], 0.2), row("q", [1], 0.6)])
    write_iteration(tmp_path, 2, [row("p", [1], 0.4), row("q", [1, 2], 0.9)])
    newest = newest_version_reward(tmp_path, 3)
    assert (newest.version, newest.rows, newest.prompts) == (1, 2, ("q", "p"))
    assert abs(newest.reward - 0.5) < 1e-12


def test_no_row_wholly_of_one_version_has_no_reward(tmp_path):
    write_iteration(tmp_path, 0, [row("p", [0, 1], 0.5), row("q", [], None)])
    newest = newest_version_reward(tmp_path, 1)
    assert newest.version is None and newest.reward is None and newest.rows == 0


def test_another_run_is_read_on_the_same_prompts_each_as_often(tmp_path):
    write_iteration(
        tmp_path,
        1,
        [row("a", [1], 1.0), row("a", [1], 0.5), row("b", [1], 0.0), row("c", [1], None)],
    )
    # a's rows average 0.75; b counts twice; c has no reward; d is not there.
    means = prompt_rewards(tmp_path, 1)
    assert means == {"a": 0.75, "b": 0.0}
    assert reward_on_prompts(means, ["a", "b", "b", "c", "d"]) == (0.75 + 0 + 0) / 3
    assert reward_on_prompts(means, ["d"]) is None
