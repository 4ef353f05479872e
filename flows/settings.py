"""Local defaults of the flow layer's environment (the variables themselves
are declared in `engines/env.py`)."""

from __future__ import annotations

import os
from pathlib import Path

from engines.env import (
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_STARTUP_TIMEOUT,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def set_local_prefect_defaults() -> None:
    """Defaults for a local run (ephemeral Prefect); set before Prefect is imported."""
    if not os.environ.get(PREFECT_API_URL):
        os.environ.setdefault(PREFECT_HOME, str(REPO_ROOT / ".prefect-home"))
    os.environ.setdefault(PREFECT_SERVER_ANALYTICS_ENABLED, "false")
    os.environ.setdefault(PREFECT_STARTUP_TIMEOUT, "120")
