"""The run's curves: metrics from an iteration's reports, the PNG, the
markdown section and the terminal sparklines."""

from __future__ import annotations

import base64
from dataclasses import replace

import pytest
from PIL import Image

from engines.weight_sync import SyncReport
from tasks.run.plans import IterationReport
from tasks.run.report import (
    IterationMetrics,
    TrainingRow,
    compact,
    curves_figure,
    curves_markdown,
    sparkline,
    terminal_curves,
    write_curves_png,
)
from training.trainer import StepReport


def report(iteration: int, rows: int = 64, tokens: int = 640, seconds: float = 2.0):
    return IterationReport(
        iteration=iteration,
        directory=f"iter-{iteration:03d}",
        shards=4,
        shards_skipped=0,
        rows=rows,
        seconds=seconds,
        generated_rows=rows,
        generated_tokens=tokens,
    )


def step(reward: float, version: int = 1, mismatch: float | None = None) -> StepReport:
    return StepReport(
        version=version,
        loss=0.0,
        grad_norm=0.0,
        mean_reward=reward,
        reward_std=0.1,
        samples=64,
        trained_samples=64,
        trained_tokens=64 * 40,
        seconds=1.5,
        staleness_max=1,
        staleness_mean=0.5,
        logprob_mismatch=mismatch,
    )


def on_policy(rewards: list[float]) -> list[IterationMetrics]:
    return [
        IterationMetrics.of(
            report(i, tokens=640 + 64 * i),
            step(r, i + 1),
            synced=SyncReport(i + 1, "broadcast", 1, seconds=0.5 - 0.1 * i),
        )
        for i, r in enumerate(rewards)
    ]


def test_metrics_of_an_iteration():
    (m,) = on_policy([0.25])
    assert (m.response_tokens, m.tokens_per_s) == (10.0, 320.0)
    assert (m.reward_mean, m.reward_std, m.sync_seconds) == (0.25, 0.1, 0.5)
    assert set(m.scalars()) == {
        "rows",
        "generate_seconds",
        "response_tokens",
        "tokens_per_s",
        "reward_mean",
        "reward_std",
        "sync_seconds",
        "staleness_max",
    }


def test_training_row_of_an_iteration():
    synced = SyncReport(2, "broadcast", 1, bytes=4_000_000, seconds=0.25)
    row = TrainingRow.of(
        report(1), step(0.5, 2, mismatch=0.0123456), synced, engine_idle_s=0.5, policy_idle_s=2.0
    )
    assert (row.iteration, row.generate_seconds, row.train_seconds) == (1, 2.0, 1.5)
    assert (row.engine_idle_seconds, row.policy_idle_seconds) == (0.5, 2.0)
    assert (row.staleness_max, row.logprob_mismatch) == (1, 0.01235)
    assert (row.weight_version, row.sync_bytes, row.sync_seconds) == (2, 4_000_000, 0.25)
    # A version published by a later sync, together with the next one.
    later = TrainingRow.of(report(1), step(0.5, 2), None, engine_idle_s=0, policy_idle_s=0)
    assert (later.weight_version, later.sync_seconds, later.logprob_mismatch) == (None,) * 3


def test_plain_and_reused_iterations_leave_out_what_does_not_apply():
    plain = IterationMetrics.of(report(0))
    assert plain.reward_mean is plain.sync_seconds is None
    assert "reward_mean" not in plain.scalars()
    reused = IterationMetrics.of(report(0, rows=0, tokens=0))  # every shard on disk
    assert reused.response_tokens is reused.tokens_per_s is None


def test_png_has_a_panel_per_curve(tmp_path):
    png = write_curves_png(on_policy([0.1, 0.2, 0.6, 0.9]), tmp_path / "curves.png")
    with Image.open(png) as image:
        assert image.format == "PNG"
        four_panels = image.size
    plain = write_curves_png([IterationMetrics.of(report(0))], tmp_path / "plain.png")
    with Image.open(plain) as image:
        assert image.size[1] < four_panels[1]  # two panels: one row, not two
    assert write_curves_png([IterationMetrics.of(report(0, 0, 0))], tmp_path / "x.png") is None


def test_sizes_rates_and_durations_are_drawn_from_zero_the_reward_as_it_lies():
    # Response tokens 7.93-8.00 (the demo's cap of 8): autoscaled, a zigzag.
    metrics = [
        IterationMetrics.of(report(i, rows=100, tokens=t), step(r, i + 1))
        for i, (t, r) in enumerate([(793, 0.5), (800, 0.6), (794, 0.7)])
    ]
    panels = {ax.get_title(): ax.get_ylim() for ax in curves_figure(metrics).axes}
    low, high = panels["response length (tokens)"]
    assert low <= 0 and high > 8.0  # 0 in view, and a margin above the top point
    assert panels["generation tokens/s"][0] <= 0
    assert panels["reward (mean ± std)"][0] > 0.3  # the band's bottom, not 0


def test_markdown_inlines_the_png_and_tabulates_each_iteration(tmp_path):
    metrics = on_policy([0.1, 0.9])
    png = write_curves_png(metrics, tmp_path / "curves.png")
    markdown = curves_markdown(metrics, png)
    encoded = base64.b64encode(png.read_bytes()).decode()
    assert f"(data:image/png;base64,{encoded})" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 2  # header + one row per iteration
    assert "| 1 | 64 | 0.9 ± 0.1 |" in table[2]


def test_terminal_curves_show_first_last_and_the_shape():
    lines = terminal_curves(on_policy([0.1, 0.2, 0.6, 0.9]))
    assert len(lines) == 5  # reward, length, tokens/s, sync, staleness (no logprobs: no mismatch)
    assert lines[0].startswith("reward") and lines[0].endswith("0.1 ▁▂▅█ 0.9")
    assert terminal_curves([]) == []


@pytest.mark.parametrize("values, line", [([0, 1], "▁█"), ([3, 3, 3], "▅▅▅"), ([1, 0.5, 0], "█▅▁")])
def test_sparkline(values, line):
    assert sparkline(values) == line


@pytest.mark.parametrize("value, text", [(1917.6, "1918"), (0.07862, "0.0786"), (15.62, "15.6")])
def test_compact(value, text):
    assert compact(value) == text


def test_dynamic_sampling_shows_its_filtered_fraction_and_the_iterations_own_reward():
    sampled = replace(
        report(0), groups=48, filtered_groups=12, refill_rounds=2, reward_mean=0.5, reward_std=0.2
    )
    # The step saw only the groups it kept: its mean is not the policy's.
    metrics = IterationMetrics.of(sampled, step(0.9))
    assert (metrics.filtered_fraction, metrics.reward_mean, metrics.reward_std) == (
        0.25,
        0.5,
        0.2,
    )
    assert "groups filtered (no signal)" in curves_markdown([metrics], None)
    row = TrainingRow.of(sampled, step(0.9), None, engine_idle_s=0.0, policy_idle_s=0.0)
    assert (row.mean_reward, row.reward_std) == (0.5, 0.2)
    # Off: no such curve, the step's reward.
    plain = IterationMetrics.of(report(0), step(0.9))
    assert (plain.filtered_fraction, plain.reward_mean) == (None, 0.9)
