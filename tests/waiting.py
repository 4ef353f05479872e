"""Waiting on a condition with a deadline, for every test (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """`predicate()`'s first truthy value, polled until `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# Deadline of a test's set-up waits (a Ray node, a Prefect server, an engine
# to be ready): on the 2-core box under a CI run beside other work (load 15-50)
# these took minutes, where an idle box takes seconds.
SETUP_TIMEOUT_S = 300.0
