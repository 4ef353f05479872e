"""The Prefect UI command the CLI prints at the end of a local run works as
copied into a shell, also one whose PATH lacks the virtual environment's bin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flows.settings import prefect_command, prefect_ui_hint

BARE_PATH = "/usr/bin:/bin"


def test_the_printed_command_runs_without_the_venv_on_path(monkeypatch):
    monkeypatch.setenv("PATH", BARE_PATH)
    hint = prefect_ui_hint("/tmp/prefect home", "run-1", local=True)
    command = prefect_command()
    assert f"api {command} server start --port 4200" in hint
    assert "PREFECT_HOME='/tmp/prefect home'" in hint
    done = subprocess.run(
        f"{command} version",
        shell=True,
        env={**os.environ, "PATH": BARE_PATH},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_the_bare_name_when_the_shell_finds_this_environment_s_prefect(monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{BARE_PATH}")
    assert prefect_command() == "prefect"
