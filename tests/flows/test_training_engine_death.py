"""An engine killed at a random moment of an on-policy training run, under
every schedule: the run completes, every (prompt, sample) is written once,
every token's version is one the run synced, and nothing of the run is left.

The moment is drawn from a seed (reported with every failure): the killer
waits for a shard of a drawn iteration, then a drawn delay (cut short by the
last iteration's first shard, so the kill always lands in the run), then
kills a drawn engine's actor: the kill falls in a generation, a policy step,
the stop of a `partial` generation's leftover segments, or a weight sync.
`partial_next` is `partial` with the next iteration's groups started beside
the policy step (`--partial-start-next`).

The suite runs `DEATH_SEEDS` seeds per schedule (few: each run is a real
flow). Run each schedule many times in a row with `ENGINE_DEATH_RUNS`:

    ENGINE_DEATH_RUNS=10 PYTHONPATH=$PWD .venv/bin/python -m pytest -q \
        tests/flows/test_training_engine_death.py

(seeds 0..9 per schedule; `-k partial_next` picks one schedule).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rollout_support import kill_engine, nothing_left, run_dirs, run_params, small_run
from waiting import wait_until

from flows.rollout import rollout
from tasks.run.shards import read_rows

ITERATIONS, PROMPTS, N = 3, 8, 2
#: Two long rows keep `partial`'s leftover segments generating through the
#: policy step; the others end at once.
LONG_TOKENS, SHORT_TOKENS = 192, 8
#: Seeds per schedule in the suite, and with ENGINE_DEATH_RUNS set.
DEATH_SEEDS = [int(s) for s in os.environ.get("ENGINE_DEATH_SEEDS", "0").split(",")]
RUNS = int(os.environ.get("ENGINE_DEATH_RUNS", "0"))
SEEDS = list(range(RUNS)) if RUNS else DEATH_SEEDS
#: The most seconds the killer waits after its iteration's first shard.
MAX_DELAY_S = 6.0


@dataclass
class Kill:
    """The drawn moment, and what the killer saw when it struck."""

    seed: int
    iteration: int
    delay_s: float
    engine: int
    killed: str | None = None
    #: Iterations with a shard written when the engine was killed.
    written: list[int] = field(default_factory=list)

    @classmethod
    def draw(cls, seed: int) -> Kill:
        rng = random.Random(seed)
        iteration, delay_s = rng.randrange(ITERATIONS - 1), round(rng.uniform(0, MAX_DELAY_S), 2)
        return cls(seed, iteration, delay_s, rng.randrange(2))

    def strike(self, output_dir: Path) -> None:
        wait_until(lambda: run_dirs(output_dir), 120, "the run directory")
        (run_dir,) = run_dirs(output_dir)
        shards = f"iter-{self.iteration:03d}/shard-*"
        wait_until(lambda: list(run_dir.glob(shards)), 600, f"iteration {self.iteration}")
        # The drawn moment, or the last iteration's first shard if that comes
        # first: its step and sync are still to run, so the kill is in the run.
        moment, last = time.monotonic() + self.delay_s, f"iter-{ITERATIONS - 1:03d}/shard-*"
        wait_until(
            lambda: time.monotonic() >= moment or list(run_dir.glob(last)),
            self.delay_s + 600,
            "the drawn moment",
        )
        self.written = sorted(
            i for i in range(ITERATIONS) if list(run_dir.glob(f"iter-{i:03d}/shard-*"))
        )
        self.killed = kill_engine(run_dir.name, self.engine)


def long_tail_prompts(path: Path) -> Path:
    rows = [
        {
            "id": f"p{i}",
            "prompt": f"Write lowercase letters after {'abcdefgh'[i] * 3}",
            "answer": "abcdefgh"[i] * 3,
            "max_tokens": LONG_TOKENS if i in (2, 5) else SHORT_TOKENS,
        }
        for i in range(PROMPTS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def training_run(model: str, tmp_path: Path, schedule: str):
    """`partial_next`: `partial` with the next groups started beside the step."""
    partial = {"partial_start_next": True} if schedule == "partial_next" else {}
    return run_params(
        **small_run(
            model,
            tmp_path / "out",
            prompts_path=str(long_tail_prompts(tmp_path / "prompts.jsonl")),
            id_field="id",
            label_field="answer",
            reward="training.rewards:target_chars_fraction",
            schedule="partial" if partial else schedule,
            iterations=ITERATIONS,
            n=N,
            max_len=LONG_TOKENS + 64,
            max_tokens=SHORT_TOKENS,
            ignore_eos=True,
            shard_size=2,
            learning_rate=0.01,
            **({} if schedule == "sync" else {"max_staleness": 1}),
            **partial,
        )
    )


def check_rows(run_dir: Path, schedule: str, synced: set[int]) -> None:
    """Every (prompt, sample) once per iteration (`partial`: every group's
    sample once over the run), each token's version one the run synced and
    within the schedule's bound."""
    bound = 0 if schedule == "sync" else 1
    seen: dict[tuple, int] = {}
    for i in range(ITERATIONS):
        rows = read_rows(run_dir / f"iter-{i:03d}")
        keys = [(r["prompt_index"], r["sample_index"]) for r in rows]
        assert sorted(keys) == [(p, k) for p in range(PROMPTS) for k in range(N)], i
        for row in rows:
            key = (row["seed"], row["prompt_index"], row["sample_index"])
            if schedule.startswith("partial"):
                key = (row["seed"], row["sample_index"])
            assert key not in seen, f"{key} written in iterations {seen[key]} and {i}"
            seen[key] = i
            versions = row["token_versions"]
            assert len(versions) == len(row["response_token_ids"]), (i, key)
            assert set(versions) <= synced, (i, key, versions, synced)
            assert versions == sorted(versions), (i, key, versions)
            assert all(i - bound <= v <= i for v in versions), (i, key, versions)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("schedule", ["partial", "partial_next", "sync", "in_flight", "overlap"])
def test_engine_killed_at_a_random_moment_never_ends_the_run(
    ray_local, tiny_model, tmp_path, schedule, seed
):
    kill = Kill.draw(seed)
    killer = threading.Thread(target=kill.strike, args=(tmp_path / "out",), daemon=True)
    killer.start()
    state = rollout(training_run(tiny_model, tmp_path, schedule), return_state=True)
    killer.join(timeout=30)
    assert kill.killed, f"{schedule}: the run ended before the kill ({kill})"
    assert state.is_completed(), f"{schedule}, {kill}: {state.message}"
    summary = state.result()
    assert [s.weight_version for s in summary.training] == [1, 2, 3], kill
    synced = {0} | {s.weight_version for s in summary.training}
    check_rows(tmp_path / "out" / summary.run_id, schedule, synced)
    nothing_left(summary.run_id)
