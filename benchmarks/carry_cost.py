"""What the `partial` schedule's carry costs on the host: the groups an
iteration leaves unfinished, with a behaviour logprob per token, are written
at the stop of what ran beside the policy step (on the sync's path, the
engines idle) and were read back at the next generation's start. Built as
`benchmarks/schedules.py --workload long-tail` makes them: `--in-flight`
x `--prompts` groups of `--n`, the batch taken by the shortest, the rest
(the longest) carried with each sample part-way through its budget.

Times, alternating round by round: `json.dumps` (the carry's writer before
orjson), `tasks.partial.segments.dumps` (now), the file's atomic write,
and its load (`CarryStore.load`, which a retry or a resumed run still
pays; the next iteration now takes the groups from the stop). Not a test:
it prints figures.

    python3 benchmarks/carry_cost.py                      # the GPU long tail's carry (--scale 4)
    python3 benchmarks/carry_cost.py --scale 1 --prompts 64
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS = 40  # the long tail's prompts, byte-tokenized, with their template


def make_carry(prompts: int, n: int, scale: int, in_flight: float, seed: int) -> list:
    from tasks.partial.segments import GroupState, SampleState
    from training.long_tail import make_rows

    rng = random.Random(seed)
    rows = make_rows(prompts, seed=seed, scale=scale)
    slots = min(2 * prompts, math.ceil(prompts * in_flight))
    budgets = sorted((int(rows[s % prompts]["max_tokens"]), s) for s in range(slots))
    groups = []
    for budget, slot in budgets[prompts:]:  # the longest: what the batch leaves
        samples = []
        for k in range(n):
            made = max(1, int(budget * rng.uniform(0.25, 1.0)))
            tokens = [rng.randrange(3, 259) for _ in range(made)]
            samples.append(
                SampleState(
                    index=k,
                    budget=budget,
                    prompt_token_ids=[rng.randrange(3, 259) for _ in range(PROMPT_TOKENS)],
                    token_ids=tokens,
                    positions=[[[t, -rng.uniform(0.0, 7.0)]] for t in tokens],
                    token_versions=[0] * made,
                    versions=[0],
                    engines=["engine-0"],
                    text="x" * made,
                    cumulative=-3.0 * made,
                    finish_reason=None if made < budget else "length",
                    segments=1,
                )
            )
        groups.append(GroupState(0, slot, slot % prompts, seed + slot, samples))
    return groups


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--in-flight", type=float, default=1.5, help="the run's partial_in_flight")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    from tasks.partial.segments import dumps

    groups = make_carry(args.prompts, args.n, args.scale, args.in_flight, args.seed)
    positions = sum(len(s.token_ids) for g in groups for s in g.samples)
    text = dumps(groups)
    if json.loads(text) != json.loads(json.dumps([g.to_json() for g in groups])):
        raise SystemExit("error: the two writers' carries differ")
    print(
        f"carry: {len(groups)} groups of {args.n}, {positions} positions, "
        f"{len(text) / 1e6:.1f} MB (--scale {args.scale}, {args.prompts} prompts)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="carry-cost-") as folder:
        seconds = time_rounds(groups, folder, args.rounds)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    for name, median in medians.items():
        print(f"{name:>10}: median {median * 1e3:8.2f} ms of {args.rounds}", flush=True)
    print(f"json.dumps / dumps: {medians['json.dumps'] / medians['dumps']:.1f}x", flush=True)
    if args.json:
        result = {"positions": positions, "bytes": len(text), "seconds": seconds}
        args.json.write_text(json.dumps({**vars(args), "json": None, **result}, indent=2))


def time_rounds(groups: list, folder: str, rounds: int) -> dict[str, list[float]]:
    """Each way of writing and reading the carry, once a round, alternating."""
    from tasks.partial.segments import CarryStore, dumps

    store = CarryStore(folder)
    timed = {
        "json.dumps": lambda: json.dumps([g.to_json() for g in groups]),
        "dumps": lambda: dumps(groups),
        "write": lambda: store.write(0, groups),
        "load": lambda: store.load(0),
    }
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name, call in timed.items():
            began = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - began)
    return seconds


if __name__ == "__main__":
    main()
