"""Helpers of the CLI tests: the CLI as a subprocess, started and stopped as
a user (or systemd, or the OOM killer) would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rollout_support import REPO, written_shards
from waiting import wait_until


def cli_args(params: dict) -> list[str]:
    """Flags of a plain run with these RolloutParams fields."""
    args = ["--plain"]
    for name, value in params.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def cli_env(**overrides: str) -> dict[str, str]:
    """The test's environment, without a Prefect API or Ray cluster unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    return {**env, **overrides}


def start_cli(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as log:  # the child holds its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_for_a_shard(
    cli: subprocess.Popen, output_dir: Path, log_path: Path, timeout_s: float = 450
) -> None:
    """Mid-generation: the first shard is on disk and the CLI still runs."""
    wait_until(lambda: written_shards(output_dir) or cli.poll() is not None, timeout_s, "a shard")
    assert cli.poll() is None, log_path.read_text()[-3000:]


def stop(cli: subprocess.Popen, signum: int, timeout_s: float = 120) -> int:
    """Send the signal and wait for the exit status (SIGKILL if it hangs)."""
    try:
        cli.send_signal(signum)
        return cli.wait(timeout=timeout_s)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
