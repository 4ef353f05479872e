"""Stopping the CLI mid-generation leaves nothing behind: the CLI's own local
Ray and local Prefect server, and every process under them, are gone once
the CLI is (checked in /proc), whatever the signal; the exit code says which.

The runs share one PREFECT_HOME, in order, so each starts while the previous
one's database (and, after SIGKILL, anything it may have left) is there: a
second CLI must not clash with the first's leftovers."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from cli_support import cli_args, cli_env, start_cli, stop, wait_for_a_shard
from processes import proc_stat
from rollout_support import long_run, written_shards
from waiting import wait_until

pytestmark = pytest.mark.slow

#: Exit status per signal: 128 + the signal for a clean stop (as a shell
#: reports a process killed by it); SIGKILL cannot be caught.
EXPECTED = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -signal.SIGKILL}


@pytest.fixture(scope="session")
def prefect_api_url() -> None:
    """Not the flow tests' Prefect harness: the CLI starts a Prefect server of its own."""
    return None


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prefect-home")


def descendants(root: int) -> set[int]:
    """Every live process under `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))):
            children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


# Each signal once, then a clean stop after the SIGKILL: the one CLI that
# starts beside whatever a killed CLI may have left in the shared home.
@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGTERM],
    ids=lambda s: signal.Signals(s).name,
)
def test_a_stopped_cli_leaves_no_process(signum, tiny_model, tmp_path, prefect_home):
    out = tmp_path / "out"
    log_path = tmp_path / "cli.log"
    # Deadlines for a loaded 2-core CI box: other tests run beside this one.
    params = long_run(tiny_model, out, num_engines=1, local_num_cpus=2, ready_timeout_s=400)
    cli = start_cli(cli_args(params), cli_env(PREFECT_HOME=str(prefect_home)), log_path)
    try:
        wait_for_a_shard(cli, out, log_path)
        started = descendants(cli.pid)
        names = " ".join(command_line(pid) for pid in started)
        assert "prefect.server.api.server" in names and "raylet" in names, names
    finally:
        returncode = stop(cli, signum)

    output = log_path.read_text()
    assert returncode == EXPECTED[signum], output[-3000:]
    assert len(written_shards(out)) < 32, "the run finished before the signal"
    # The CLI waits for what it stops; after SIGKILL the kernel's parent-death
    # signal and Ray's own fate sharing take a moment.
    left = lambda: {pid: command_line(pid) for pid in started if proc_stat(pid)}  # noqa: E731
    try:
        wait_until(lambda: not left(), 30, "the CLI's processes to end")
    except AssertionError:
        pytest.fail(f"processes of the CLI survived it: {left()}")
    if signum != signal.SIGKILL:
        name = signal.Signals(signum).name
        last = output.strip().splitlines()[-1]
        assert last.startswith(f"{name}: stopped the run (Crashed"), output[-3000:]
        assert "the local Ray" in last and "the local Prefect server" in last
        assert "SIGTERM received" not in output and "Traceback" not in output, output[-3000:]
