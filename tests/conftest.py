"""Session fixtures shared by every test: the tiny model and one local Ray;
and the leak guard (tests/leak_guard.py) after every module."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from leak_guard import GUARD, _leak_guard, pytest_fixture_setup  # noqa: F401 - the guard's fixture and hook
from waiting import SETUP_TIMEOUT_S

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Every test session gets its own Prefect home: ~/.prefect is shared. A
# pytest run inside a test shares its parent's; the one that made it removes it.
OWN_PREFECT_HOME = None
if "PREFECT_HOME" not in os.environ:
    OWN_PREFECT_HOME = os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="rolloutflow-prefect-")
# Ray's own start-up deadlines (a raylet waits 30 s for its agents, a worker
# process gets 60 s to register) are fixed for an idle machine; on the 2-core
# box under a CI run beside other work they were missed. Every Ray node the
# tests start (local, `ray start`, a CLI's) inherits these.
os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")
os.environ.setdefault("RAY_worker_register_timeout_seconds", "300")

# Logical CPUs for the local Ray: engines, trainer and tasks each take one
# bundle CPU; the work itself is tiny, so more logical than physical is fine.
RAY_NUM_CPUS = 8


def pytest_unconfigure(config):
    if OWN_PREFECT_HOME:  # after the session's fixtures, the Prefect server's among them
        shutil.rmtree(OWN_PREFECT_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from engines.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama"))


def start_local_ray():
    import ray

    if not ray.is_initialized():
        with GUARD.session_owned():  # ends with the session (or a test's ray.shutdown)
            ray.init(
                address="local",
                num_cpus=RAY_NUM_CPUS,
                include_dashboard=False,
                namespace="rolloutflow-tests",
            )
    return ray


@pytest.fixture
def ray_local():
    """A local Ray cluster, shared by the tests that use it and shut down at the
    end of the session (never `ray stop`: it ends every Ray process on the
    machine). Tests that need another cluster shut this one down first; the
    next test that asks for it starts it again."""
    return start_local_ray()


@pytest.fixture(scope="module")
def ray_local_module():
    """`ray_local` for module-scoped fixtures."""
    return start_local_ray()


@pytest.fixture(scope="session")
def prefect_api_url() -> str:
    """One Prefect test harness (a temporary server with SQLite) for every
    test of the session that runs a flow: without it the first flow starts
    Prefect's own temporary server, which lives until the process ends."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=SETUP_TIMEOUT_S):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_exit():
    yield
    import ray

    ray.shutdown()
