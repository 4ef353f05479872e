"""A run's summary: what each iteration made and how long the run took,
written to `<run>/summary.json`, published as the run's artifact (with the
curves) and returned by the flow."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flows.iterations import Ledger
from flows.params import RolloutParams
from tasks.run.artifacts import publish_summary
from tasks.run.plans import IterationReport
from tasks.run.pool import EnginePool
from tasks.run.report import (
    CURVES_FILE,
    IterationMetrics,
    TrainingRow,
    curves_markdown,
    write_curves_png,
)
from tasks.run.scope import RunScope
from tasks.run.shards import write_atomically

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    attempt: int
    output_dir: str
    rows: int
    #: Requests sent to engines by this attempt (shards written by an earlier
    #: attempt of the run are reused, not regenerated).
    generate_calls: int
    seconds: float
    #: Of which the iterations (generate, train, sync), after start-up (a
    #: colocated policy's, which starts after the engines, included).
    iterations_seconds: float
    iterations: list[IterationReport]
    #: On-policy runs: per iteration, the policy step and the sync after it.
    training: list[TrainingRow]
    #: Per iteration: what the curves show.
    metrics: list[IterationMetrics]
    #: The curves as a PNG (None when there is nothing to draw).
    curves: str | None


def summarize(
    params: RolloutParams,
    scope: RunScope,
    pool: EnginePool,
    ledger: Ledger,
    run_dir: Path,
    began: float,
    looped_s: float,
) -> RunSummary:
    """The run's summary: written to summary.json and published as its artifact."""
    reports = [ledger.reports[i] for i in sorted(ledger.reports)]
    curves = write_curves_png(ledger.metrics, run_dir / CURVES_FILE)
    summary = RunSummary(
        run_id=scope.run_id,
        attempt=scope.attempt,
        output_dir=str(run_dir),
        rows=sum(report.rows for report in reports),
        generate_calls=sum(stats.generate_calls for stats in pool.stats),
        seconds=round(time.monotonic() - began, 2),
        iterations_seconds=round(looped_s, 2),
        iterations=reports,
        training=ledger.training,
        metrics=ledger.metrics,
        curves=str(curves) if curves else None,
    )
    write_atomically(run_dir / SUMMARY_FILE, [json.dumps(asdict(summary), indent=2)])
    markdown = summary_markdown(summary, pool) + "\n\n" + curves_markdown(ledger.metrics, curves)
    publish_summary(markdown)
    return summary


def summary_markdown(summary: RunSummary, pool: EnginePool) -> str:
    lines = [
        "# Rollout run",
        "",
        f"- output: `{summary.output_dir}`",
        f"- rows: {summary.rows} (attempt {summary.attempt}, {summary.seconds:.1f} s)",
        f"- engine requests this attempt: {summary.generate_calls}",
        f"- engine restarts: {sum(s.restarts for s in pool.stats)}",
        "",
        "| iteration | shards | reused | rows | seconds |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.iteration} | {r.shards} | {r.shards_skipped} | {r.rows} | {r.seconds:.1f} |"
        for r in summary.iterations
    ]
    return "\n".join(lines)
