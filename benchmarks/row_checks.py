"""What a schedules benchmark run wrote, checked row by row: each token's
weight version, and every (group, sample) written once. The rows' versions
are those the engines reported (tasks/partial/segments.py copies them: the CPU
engine's per token, vLLM's per segment); this checks they fit the run:
one per token, never decreasing, within the run's bound of the iteration,
and listed in the row's `weight_versions`. Also the reward of the rows the
newest version sampled wholly (`newest_version_reward`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.partial.task import CarryStore
from tasks.run.shards import read_rows


@dataclass(frozen=True)
class RowChecks:
    rows: int
    #: Rows whose token versions do not fit (see the module's doc).
    bad_versions: int
    #: (group seed, sample) written more than once, or both written and carried.
    duplicates: int
    #: Iterations that do not hold batch x n rows.
    short_iterations: int

    @property
    def ok(self) -> bool:
        return not (self.bad_versions or self.duplicates or self.short_iterations)


@dataclass(frozen=True)
class NewestReward:
    """The newest weight version that sampled some of a run's rows wholly,
    those rows' mean reward, how many there are, and their prompts (to hold
    `sync`'s rows of that version on the same prompts against them)."""

    version: int | None
    reward: float | None
    rows: int
    prompts: tuple[str, ...]


def newest_version_reward(run_dir: Path, iterations: int) -> NewestReward:
    """The reward of the policy after the most steps that a run's rows
    show. Iteration `i` samples on version `i`: under `sync` all its rows
    are wholly that version's, so the newest is the last iteration's.
    Under `partial` a batch also holds groups begun under older versions,
    and with `partial_start_next` every group of the last batch began a
    version back (beside the step before), so its newest wholly sampled
    rows are version `iterations - 2`'s, in that batch or the one before.
    A batch's mean mixes those versions; this reads one policy, to set
    beside `sync`'s rows of the same version (biased toward short rows
    under `partial`: the long ones span versions)."""
    by_version: dict[int, list[dict]] = {}
    for i in range(iterations):
        for row in read_rows(run_dir / f"iter-{i:03d}"):
            if len(versions := set(row["token_versions"])) == 1:
                by_version.setdefault(versions.pop(), []).append(row)
    if not by_version:
        return NewestReward(None, None, 0, ())
    version = max(by_version)
    newest = by_version[version]
    scored = [r["reward"] for r in newest if r["reward"] is not None]
    reward = sum(scored) / len(scored) if scored else None
    return NewestReward(version, reward, len(newest), tuple(r["prompt"] for r in newest))


def prompt_rewards(run_dir: Path, iteration: int) -> dict[str, float]:
    """Iteration `iteration`'s mean reward per prompt (rows without one left
    out): kept in the benchmark's JSON, so that runs of other calls can be
    read against it without their rows."""
    by_prompt: dict[str, list[float]] = {}
    for row in read_rows(run_dir / f"iter-{iteration:03d}"):
        if row["reward"] is not None:
            by_prompt.setdefault(row["prompt"], []).append(row["reward"])
    return {prompt: sum(r) / len(r) for prompt, r in by_prompt.items()}


def reward_on_prompts(means: dict[str, float], prompts: list[str]) -> float | None:
    """The mean over `prompts` (one entry per row wanted: a prompt listed
    twice weighs twice) of their `prompt_rewards`."""
    found = [means[p] for p in prompts if p in means]
    return sum(found) / len(found) if found else None


def check_rows(run_dir: Path, iterations: int, rows_per_iteration: int, bound: int) -> RowChecks:
    """`bound`: iterations a row's oldest token may lag its iteration (0
    under sync). Partial runs: no group both written and still carried."""
    written: set[tuple[int, int, int | None]] = set()
    bad = duplicates = short = count = 0
    partial = (run_dir / "partial").is_dir()
    for i in range(iterations):
        rows = read_rows(run_dir / f"iter-{i:03d}")
        count += len(rows)
        short += len(rows) != rows_per_iteration
        for row in rows:
            # A partial row's group is its seed; a sync row's its iteration's prompt.
            key = (row["seed"], row["sample_index"], None if partial else i)
            duplicates += key in written
            written.add(key)
            versions = row["token_versions"]
            bad += not (
                len(versions) == len(row["response_token_ids"])
                and versions == sorted(versions)
                and (not versions or i - bound <= versions[0] <= versions[-1] <= i)
                and set(versions) <= set(row["weight_versions"])
                and row["weight_version"] == row["weight_versions"][0]
            )
    if partial:
        carried = {g.seed for g in CarryStore(run_dir).load(iterations - 1)}
        duplicates += len(carried & {seed for seed, _, _ in written})
    return RowChecks(count, bad, duplicates, short)
