"""Every flow test runs under the session's Prefect test harness
(tests/conftest.py): starting one takes seconds."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _flows_use_the_harness(prefect_api_url) -> str:
    return prefect_api_url
