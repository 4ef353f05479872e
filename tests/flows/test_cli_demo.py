"""The README's main command on the embedded default: local Ray started by
the run, ephemeral Prefect, the tiny model, the shipped prompts file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_support import NUM_PROMPTS, REPO, rows_by_prompt

from tasks.shards import read_rows

pytestmark = pytest.mark.slow


def test_cli_demo_prints_where_the_output_went(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "--output-dir",
            str(tmp_path / "out"),
            "--num-engines",
            "1",
            "--model",
            tiny_model,
            "--max-tokens",
            "8",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    match = re.search(r"(\d+) rollouts written to (\S+)", done.stdout)
    assert match, done.stdout[-2000:]
    assert int(match.group(1)) == NUM_PROMPTS
    rows = rows_by_prompt(read_rows(Path(match.group(2)) / "iter-000"))
    assert sorted(rows) == [(p, 0) for p in range(NUM_PROMPTS)]


def test_cli_rejects_bad_flags_before_starting_anything(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--num-engines", "0", "--output-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "num_engines" in done.stderr and "greater than or equal to 1" in done.stderr
    assert not any(tmp_path.iterdir())
