"""The run's curves: metrics from an iteration's reports, the PNG, the
markdown section and the terminal sparklines."""

from __future__ import annotations

import base64

import pytest
from PIL import Image

from tasks.generate import IterationReport
from tasks.report import (
    IterationMetrics,
    compact,
    curves_markdown,
    sparkline,
    terminal_curves,
    write_curves_png,
)


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


def on_policy(rewards: list[float]) -> list[IterationMetrics]:
    return [
        IterationMetrics.of(
            report(i, tokens=640 + 64 * i),
            step={"mean_reward": r, "reward_std": 0.1},
            synced={"seconds": 0.5 - 0.1 * i},
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
    }


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
    assert len(lines) == 4
    assert lines[0].startswith("reward") and lines[0].endswith("0.1 ▁▂▅█ 0.9")
    assert terminal_curves([]) == []


@pytest.mark.parametrize("values, line", [([0, 1], "▁█"), ([3, 3, 3], "▅▅▅"), ([1, 0.5, 0], "█▅▁")])
def test_sparkline(values, line):
    assert sparkline(values) == line


@pytest.mark.parametrize("value, text", [(1917.6, "1918"), (0.07862, "0.0786"), (15.62, "15.6")])
def test_compact(value, text):
    assert compact(value) == text
