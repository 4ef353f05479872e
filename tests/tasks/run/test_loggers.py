"""Experiment loggers: TensorBoard event files read back with tensorboard's
own reader, and the checks that fail a run before it creates anything."""

from __future__ import annotations

import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_report import on_policy

from tasks.run.loggers import (
    TENSORBOARD_DIR,
    LoggerUnavailableError,
    check_logger,
    open_logger,
)


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_holds_one_point_per_iteration_per_metric(tmp_path):
    metrics = on_policy([0.1, 0.4, 0.8])
    logger = open_logger("tensorboard", tmp_path, "run-1", {})
    for m in metrics:
        logger.log(m)
    logger.close()
    scalars = read_scalars(tmp_path / TENSORBOARD_DIR)
    assert set(scalars) == {f"rollout/{name}" for name in metrics[0].scalars()}
    for points in scalars.values():
        assert [step for step, _ in points] == [0, 1, 2]
    rewards = [value for _, value in scalars["rollout/reward_mean"]]
    assert rewards == pytest.approx([0.1, 0.4, 0.8])


def test_no_logger():
    check_logger("none")
    assert open_logger("none", None, "run-1", {}) is None


def test_a_logger_without_its_package_is_refused(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(LoggerUnavailableError, match=r"rolloutflow\[wandb\]"):
        check_logger("wandb")


def test_wandb_gets_the_same_points(monkeypatch, tmp_path):
    """W&B is not installed here: a stand-in module records the calls."""
    calls = []

    class Run:
        def log(self, scalars, step):
            calls.append(("log", step, scalars))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    metrics = on_policy([0.1, 0.9])
    logger = open_logger("wandb", tmp_path, "run-1", {"n": 8})
    for m in metrics:
        logger.log(m)
    logger.close()
    assert calls[0] == (
        "init",
        {"project": "rolloutflow", "name": "run-1", "dir": str(tmp_path), "config": {"n": 8}},
    )
    assert [c[1] for c in calls[1:3]] == [0, 1]
    assert calls[2][2]["rollout/reward_mean"] == 0.9
    assert calls[3] == ("finish",)
