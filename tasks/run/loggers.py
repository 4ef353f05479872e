"""Experiment loggers for a run's per-iteration metrics, picked by the run's
`logger` parameter: TensorBoard event files under the run directory (works
offline), or Weights & Biases when it is installed. One point per iteration
per metric, the iteration as the step."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

from tasks.run.report import IterationMetrics

TENSORBOARD_DIR = "tensorboard"
#: Logger -> the package it needs and the extra that installs it.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class LoggerUnavailableError(RuntimeError):
    """The chosen logger's package is not installed."""


class MetricsLogger(Protocol):
    def log(self, metrics: IterationMetrics) -> None: ...

    def close(self) -> None: ...


def check_logger(kind: str) -> None:
    """Fail before the run creates anything when the logger cannot work here."""
    package = PACKAGES.get(kind)
    if package and importlib.util.find_spec(package) is None:
        raise LoggerUnavailableError(
            f"logger {kind!r} needs the {package} package, which is not installed: "
            f"pip install 'rolloutflow[{kind}]'"
        )


def open_logger(
    kind: str, run_dir: Path, run_id: str, config: dict[str, Any]
) -> MetricsLogger | None:
    if kind == "tensorboard":
        return TensorBoardLogger(run_dir / TENSORBOARD_DIR)
    if kind == "wandb":
        return WandbLogger(run_dir, run_id, config)
    return None


def tag(name: str) -> str:
    return f"rollout/{name}"


class TensorBoardLogger:
    def __init__(self, log_dir: Path):
        # torch's writer (torch is already a dependency) writes through the
        # tensorboard package; the OpenRLHF trainers use the same one.
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: IterationMetrics) -> None:
        for name, value in metrics.scalars().items():
            self.writer.add_scalar(tag(name), value, metrics.iteration)
        self.writer.flush()  # a long run shows each iteration as it ends

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any]):
        import wandb  # optional: check_logger said it is installed

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rolloutflow"),
            name=run_id,
            dir=str(run_dir),
            config=config,
        )

    def log(self, metrics: IterationMetrics) -> None:
        scalars = {tag(name): value for name, value in metrics.scalars().items()}
        self.run.log(scalars, step=metrics.iteration)

    def close(self) -> None:
        self.run.finish()
