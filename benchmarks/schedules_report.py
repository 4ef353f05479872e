"""What the schedules benchmark prints and writes (`benchmarks/schedules.py`):
its table of runs, each schedule's mean over its seeds, the reward against
`sync`'s spread, the ceilings of overlap at `sync`'s step times, and the
JSON that `benchmarks/merge_schedules.py` reads back."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.schedule_run import ScheduleRun


def table(results: list[ScheduleRun]) -> str:
    syncs = [r.steps_per_hour for r in results if r.schedule == "sync"]
    base = statistics.fmean(syncs) if syncs else results[0].steps_per_hour
    header = (
        f"{'schedule':<12} {'seed':>4} {'steps/h':>8} {'x sync':>7} {'reward':>13} {'stale':>5} "
        f"{'trained':>7} {'gen s':>6} {'train s':>7} {'sync s':>6} {'other s':>7} {'stop s':>6} "
        f"{'eng idle':>8} "
        f"{'idle %':>6} {'pol idle':>8} {'rows ok':>7}"
    )
    lines = [header]
    for r in results:
        lines.append(
            f"{r.schedule:<12} {r.seed:>4} {r.steps_per_hour:>8.0f} "
            f"{r.steps_per_hour / base:>6.2f}x "
            f"{r.reward_first:>5.3f}->{r.reward_last:<6.3f} {r.staleness_max:>5} "
            f"{r.trained_samples:>7} "
            f"{r.generate_s:>6.2f} {r.train_s:>7.2f} {r.sync_s:>6.3f} "
            f"{r.other_s:>7.2f} {'-' if r.stop_s is None else f'{r.stop_s:.3f}':>6} "
            f"{r.engine_idle_s:>8.2f} {100 * r.engine_idle_fraction:>5.1f}% "
            f"{r.policy_idle_s:>8.2f} {'yes' if r.rows_ok else 'NO':>7}"
        )
    return "\n".join(lines)


def ceiling(sync: ScheduleRun) -> float:
    """The most `overlap` can gain over `sync` at `sync`'s own step times: one
    iteration costs generate + train + sync one after the other, and at best
    max(generate, train) + sync when the two overlap. `in_flight` may pass it:
    it runs two generations at once (max_staleness 1), which on latency-bound
    engines cost little more than one (see `in_flight_ceiling`)."""
    serial = sync.generate_s + sync.train_s + sync.sync_s
    return serial / (max(sync.generate_s, sync.train_s) + sync.sync_s)


def in_flight_ceiling(sync: ScheduleRun) -> float:
    """`in_flight`'s gain at max_staleness 1 if two generations at once cost
    what one does: an iteration then costs max(serial / 2, train + sync)."""
    serial = sync.generate_s + sync.train_s + sync.sync_s
    return serial / max(serial / 2, sync.train_s + sync.sync_s)


def spread(results: list[ScheduleRun]) -> str | None:
    """Each other schedule's last batch's reward against the range over the
    `sync` runs' seeds, then the reward of its newest version's own rows
    (`row_checks.newest_version_reward`) against `sync`'s of that version."""
    from benchmarks.row_checks import reward_on_prompts

    syncs = [r.reward_last for r in results if r.schedule == "sync"]
    if len(syncs) < 2:
        return None
    low, high = min(syncs), max(syncs)
    lines = [f"sync's reward after the same steps over {len(syncs)} seeds: {low:.3f}-{high:.3f}"]
    for r in results:
        if r.schedule != "sync":
            where = "within" if low <= r.reward_last <= high else "outside"
            where += " (above)" if r.reward_last > high else ""
            lines.append(f"{r.schedule}: {r.reward_last:.3f} ({where} sync's spread)")
    lines.append(
        "the newest policy each run's rows show (the version that sampled some wholly), "
        "against sync's rows of that version on the same prompts:"
    )
    sync_by_seed = {r.seed: r for r in results if r.schedule == "sync"}
    for r in results:
        version = r.newest_version
        line = (
            f"  {r.schedule} seed {r.seed}: version {version}, "
            f"{fmt(r.reward_newest)} ({r.rows_newest} rows)"
        )
        same_seed = sync_by_seed.get(r.seed)
        by_prompt = same_seed.reward_by_prompt if same_seed else []
        if r.schedule != "sync" and version is not None and version < len(by_prompt):
            # Those rows lean to the short prompts: sync's rows of that
            # version (its iteration) on the same prompts are like for like.
            matched = reward_on_prompts(by_prompt[version], r.prompts_newest)
            line += f"; sync seed {r.seed}, version {version}, same prompts: {fmt(matched)}"
        lines.append(line)
    return "\n".join(lines)


def fmt(reward: float | None) -> str:
    return "-" if reward is None else f"{reward:.3f}"


def means(results: list[ScheduleRun]) -> str:
    """Per schedule over its runs: steps/h against `sync`'s mean, the share of
    wall time the engines idled, and whether every run's rows passed the checks."""
    by: dict[str, list[ScheduleRun]] = {}
    for r in results:
        by.setdefault(r.schedule, []).append(r)

    def mean(rs: list[ScheduleRun], key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in rs)

    base = mean(by.get("sync", results), "steps_per_hour")
    return "\n".join(
        f"{name}: {len(rs)} runs, steps/h {mean(rs, 'steps_per_hour') / base:.2f}x mean sync, "
        f"idle {100 * mean(rs, 'engine_idle_fraction'):.1f}%, "
        f"rows checked: {'ok' if all(r.rows_ok for r in rs) else 'FAILED'}"
        for name, rs in by.items()
    )


def report(args: argparse.Namespace, results: list[ScheduleRun], seconds: float) -> None:
    print(f"\n{table(results)}\n(per iteration means; {seconds:.0f} s in all)")
    print(means(results))
    if (line := spread(results)) is not None:
        print(line)
    sync = next((r for r in results if r.schedule == "sync"), None)
    most = ceiling(sync) if sync else None
    if most is not None:
        print(f"ceiling of overlap at sync's step times: {most:.2f}x")
        print(
            f"in_flight, if two generations at once cost one: {in_flight_ceiling(sync):.2f}x "
            "(at max_staleness 1)",
            flush=True,
        )
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        data = {"args": settings, "results": [r.to_json() for r in results], "ceiling": most}
        args.json.write_text(json.dumps(data, indent=2))
