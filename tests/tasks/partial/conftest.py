"""Two CPU engines of the tiny model for the partial runner's tests."""

from __future__ import annotations

import pytest
import ray
from partial_engines import MAX_LEN
from waiting import SETUP_TIMEOUT_S

from engines import create_vllm_engines, destroy_engines
from tasks.run.pool import EnginePool


@pytest.fixture
def pool(ray_local, tiny_model):
    engines = create_vllm_engines(2, tiny_model, MAX_LEN, backend="hf", name_prefix="resume")
    ray.get([e.ready.remote() for e in engines], timeout=SETUP_TIMEOUT_S)
    yield EnginePool(engines)
    destroy_engines(engines)
