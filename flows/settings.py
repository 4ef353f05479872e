"""Local defaults of the flow layer's environment (the variables themselves
are declared in `engines/env.py`)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from engines.env import (
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_STARTUP_TIMEOUT,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The demo's files, packaged with `flows` (links to data/ in a checkout;
#: copies in a wheel), so the installed command runs anywhere: the plain
#: job's prompts, and the demo's labelled task (`training.letter_task`, kind
#: repeat).
PACKAGED_PROMPTS = Path(__file__).resolve().parent / "demo" / "prompts.jsonl"
PACKAGED_TASK = Path(__file__).resolve().parent / "demo" / "letter_repeat.jsonl"


def local_prefect_home() -> Path:
    """The checkout's `.prefect-home` (runs of a checkout share one history);
    for an installed package, one under the user's cache."""
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT / ".prefect-home"
    return Path.home() / ".cache" / "rolloutflow" / "prefect-home"


def set_local_prefect_defaults() -> None:
    """Defaults for a local run (a local Prefect server); set before Prefect is imported."""
    if not os.environ.get(PREFECT_API_URL):
        os.environ.setdefault(PREFECT_HOME, str(local_prefect_home()))
    os.environ.setdefault(PREFECT_SERVER_ANALYTICS_ENABLED, "false")
    os.environ.setdefault(PREFECT_STARTUP_TIMEOUT, "120")


def prefect_command() -> str:
    """The `prefect` executable as a shell finds it: the bare name when PATH
    leads to this environment's, else the one beside this Python by its full
    path (a virtual environment's bin is often not on PATH)."""
    beside = Path(sys.executable).parent / "prefect"
    if not beside.is_file():
        return "prefect"
    on_path = shutil.which("prefect")
    if on_path and os.path.samefile(on_path, beside):
        return "prefect"
    return shlex.quote(str(beside))


def prefect_ui_hint(prefect_home: str, run_id: str, local: bool, port: int = 4200) -> str:
    """How to open the run in the Prefect UI. The CLI's local server ended
    with it: a server started on the same database shows the run."""
    if not local:
        ui = os.environ.get("PREFECT_UI_URL") or os.environ[PREFECT_API_URL].removesuffix("/api")
        return f"the run in the Prefect UI: {ui}/runs/flow-run/{run_id}"
    return (
        f"to see the run in the Prefect UI: PREFECT_HOME={shlex.quote(prefect_home)} "
        f"PREFECT_UI_API_URL=http://127.0.0.1:{port}/api {prefect_command()} server start "
        f"--port {port}\n"
        f"  then open http://127.0.0.1:{port}/runs/flow-run/{run_id}"
    )
