"""Fixtures of the session tests on a fake engine (fake_engine.py)."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, model, state

from engines.weight_sync.transports import checkpoint


@pytest.fixture
def engine():
    return FakeEngine(model(0))


@pytest.fixture
def new_weights(tmp_path):
    trained = model(1)
    path = checkpoint.save(trained.named_parameters(), tmp_path / "v1", version=1)
    return str(path), state(trained)
