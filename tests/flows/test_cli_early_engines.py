"""The CLI starts the run's engines early, on the local Ray it started, only
for a run whose input passes the flow's checks (flows/cli.py
`start_engines_early`). Engine creation is faked; the CLI demo test runs the
real thing and checks that the flow took the early engines."""

from __future__ import annotations

import pytest
import ray

import tasks.engines as engines_tasks
from flows.arguments import parse_params
from flows.cli import checked_model, start_engines_early
from flows.rollout import engine_set


@pytest.fixture(scope="session")
def prefect_api_url() -> None:
    """No Prefect server: nothing here runs a flow."""
    return None


@pytest.fixture
def started(monkeypatch) -> list:
    requests: list = []
    monkeypatch.setattr(engines_tasks, "start_early", requests.append)
    # The local Ray the CLI would have started: two CPUs, no GPU.
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    return requests


def test_the_run_s_engines_start_early(started, tiny_model):
    params = parse_params(["--model", tiny_model])
    assert checked_model(params) == tiny_model
    start_engines_early(params, tiny_model)
    assert started == [engine_set(params, tiny_model, "hf")]


@pytest.mark.parametrize(
    "flags", [["--prompt-field", "question"], ["--reward", "no_such_module:reward"]]
)
def test_a_run_that_fails_on_its_input_gets_no_early_engines(tiny_model, flags):
    assert checked_model(parse_params(["--model", tiny_model, *flags])) is None


def test_no_early_engines_beyond_the_cluster(started, tiny_model):
    start_engines_early(parse_params(["--model", tiny_model, "--num-engines", "3"]), tiny_model)
    assert started == []
