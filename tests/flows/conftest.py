"""One Prefect test harness (a temporary server with SQLite) for every flow
test of the session: starting one takes seconds."""

from __future__ import annotations

import pytest
from waiting import SETUP_TIMEOUT_S


@pytest.fixture(scope="session", autouse=True)
def prefect_api_url() -> str:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=SETUP_TIMEOUT_S):
        yield PREFECT_API_URL.value()
