"""The README's main command: the demo preset (a few on-policy iterations on
the packaged labelled task) with the CLI's own local Ray and Prefect server,
the tiny model, run from another directory than the checkout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_support import REPO, rows_by_prompt

from flows.arguments import DEMO_PRESET
from tasks.run.shards import read_rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def prefect_api_url() -> None:
    """Not the flow tests' Prefect harness: the CLI starts a Prefect server of its own."""
    return None


def test_cli_demo_teaches_and_says_where_everything_is(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PYTHONPATH"] = str(REPO)  # the checkout's code, from another directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--model", tiny_model],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    iterations = DEMO_PRESET["training"]["iterations"]
    assert len(re.findall(r"^iteration \d+: mean reward", done.stdout, re.M)) == iterations
    match = re.search(r"(\d+) rollouts written to (\S+)", done.stdout)
    assert match, done.stdout[-2000:]
    prompts = len(Path(DEMO_PRESET["data"]["prompts_path"]).read_text().splitlines())
    samples = DEMO_PRESET["sampling"]["n"]
    assert int(match.group(1)) == prompts * samples * iterations
    run_dir = elsewhere / match.group(2)
    assert run_dir.is_relative_to(elsewhere / "out")
    rows = read_rows(run_dir / "iter-000")
    assert sorted(rows_by_prompt(rows)) == [(p, s) for p in range(prompts) for s in range(samples)]
    assert {row["label"] for row in rows} == {"a", "b"}  # the labelled task, with its labels
    # It teaches: the policy learns to answer with the letter its prompt
    # repeats. The demo's seed goes from about 0.005 to about 1; a policy
    # answering one letter always would score 0.5.
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [m["reward_mean"] for m in summary["metrics"]]
    assert rewards[0] < 0.1 and rewards[-1] > 0.45, rewards
    assert Path(summary["curves"]).read_bytes().startswith(b"\x89PNG"), summary["curves"]
    assert f"curves: {summary['curves']}" in done.stdout
    assert "Prefect API: local server at http://127.0.0.1:" in done.stdout
    assert f"PREFECT_HOME={env['PREFECT_HOME']}" in done.stdout
    assert f"/runs/flow-run/{run_dir.name}" in done.stdout
    # The flow took the engine the CLI started beside Prefect's server.
    early = r"create_engines-\w+' - using \['rolloutflow-engine-[0-9a-f]{8}-0'\], started"
    assert re.search(early, done.stdout + done.stderr), done.stderr[-3000:]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-engines", "0"], "--num-engines '0': Input should be greater than or equal to 1"),
        # A pair of flags the run would not honour together (flows/params.py).
        (
            ["--schedule", "partial", "--dynamic-sampling"],
            "parameters: --dynamic-sampling does not work with --schedule partial",
        ),
    ],
)
def test_cli_rejects_bad_flags_before_starting_anything(flags, message, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *flags, "--output-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert message in done.stderr
    # The message alone: no traceback, and no Prefect server or Ray started.
    assert "Traceback" not in done.stderr and done.stdout == "", done.stderr
    assert not any(tmp_path.iterdir())
