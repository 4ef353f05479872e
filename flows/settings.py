"""Environment variables the flow layer (flows/ and tasks/) reads or sets.
The engine layer's own are in `engines/env.py`."""

from __future__ import annotations

import os
from pathlib import Path

#: Ray's own: the cluster to connect to when the `address` parameter is empty.
RAY_ADDRESS = "RAY_ADDRESS"

#: Prefect's home (profiles, local database). The CLI points it at the
#: repository's `.prefect-home` unless set: the default `~/.prefect` is shared
#: by every project of the user.
PREFECT_HOME = "PREFECT_HOME"
#: Prefect's API; when set, the CLI leaves PREFECT_HOME alone (a real server).
PREFECT_API_URL = "PREFECT_API_URL"
#: Off: analytics writes to the local SQLite database and causes
#: "database is locked" noise.
PREFECT_SERVER_ANALYTICS_ENABLED = "PREFECT_SERVER_ANALYTICS_ENABLED"

REPO_ROOT = Path(__file__).resolve().parent.parent


def set_local_prefect_defaults() -> None:
    """Defaults for a local run (ephemeral Prefect); set before Prefect is imported."""
    if not os.environ.get(PREFECT_API_URL):
        os.environ.setdefault(PREFECT_HOME, str(REPO_ROOT / ".prefect-home"))
    os.environ.setdefault(PREFECT_SERVER_ANALYTICS_ENABLED, "false")
