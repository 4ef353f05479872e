"""Admission by load with real CPU engines on a real Ray: an engine slowed
down (each forward pass of its model takes `STEP_S` longer) is kept at a
window of one shard and gets a small share of the work."""

from __future__ import annotations

import time

import pytest
import ray

from engines import EngineSet
from engines.config import EngineConfig
from engines.hf import HFEngine
from engines.load import EngineLoad
from engines.sampling import SamplingParams
from tasks.run.dispatch import run_shards
from tasks.run.pool import EnginePool
from tasks.run.shards import plan_shards

CAP = 4
PARAMS = SamplingParams(n=2, max_tokens=12, ignore_eos=True)
#: What the slowed engine adds to each forward pass (13 per batch here).
STEP_S = 0.05


def slowed_engine(step_s: float) -> type:
    """The CPU engine, each forward pass `step_s` longer. Nested, so Ray
    pickles the class by value (the test module is not on the workers' path)."""

    class SlowedHFEngine(HFEngine):
        def __init__(self, config: EngineConfig):
            super().__init__(config)
            forward = self._runner._forward

            def slowed(*args, **kwargs):
                time.sleep(step_s)  # on the generation thread: the engine is slower
                return forward(*args, **kwargs)

            self._runner._forward = slowed

    return SlowedHFEngine


@pytest.fixture
def engines(ray_local, tiny_model):
    configs = [
        EngineConfig(
            name=f"load-{i}",
            pretrain=tiny_model,
            max_len=64,
            seed=i,
            gpu_memory_utilization=0.5,
            rpc_timeout_s=60,
        )
        for i in range(2)
    ]
    classes = [HFEngine, slowed_engine(STEP_S)]
    handles = [
        ray.remote(cls).options(num_cpus=0).remote(c)
        for cls, c in zip(classes, configs, strict=True)
    ]
    ray.get([handle.ready.remote() for handle in handles], timeout=300)
    yield EngineSet(
        handles, configs=configs, name_prefix="load", namespace="t", backend="hf", placement=None
    )
    for handle in handles:
        ray.kill(handle)


def test_idle_engine_reports_no_load(engines):
    assert ray.get(engines[0].load.remote(), timeout=60) == EngineLoad(0, 0, 0.0)


def test_a_slowed_engine_gets_a_window_of_one_and_less_work(engines):
    pool = EnginePool(engines)
    written: dict[int, str] = {}

    def submit(engine, shard):
        handle = pool.engines[engine]
        return [
            handle.generate_text.remote(f"prompt {i}", PARAMS.model_copy(update={"seed": i}))
            for i in range(shard.start, shard.stop)
        ]

    def on_done(shard, engine, results, seconds):
        assert shard.index not in written, "a shard was written twice"
        written[shard.index] = pool.name(engine)

    shards = plan_shards(72, 3)
    run_shards(pool, shards, submit, on_done, per_engine=CAP, timeout_s=300)
    assert sorted(written) == list(range(len(shards)))
    fast, slow = pool.stats
    print(f"shards {fast.shards} / {slow.shards}, peak {fast.peak_shards} / {slow.peak_shards}")
    assert fast.shards + slow.shards == len(shards)
    # Its shards take several times as long: the slowed engine's window never
    # grows past one, the other's grows to the cap and it does the bulk.
    assert slow.peak_shards == 1 and pool.windows.allowed(1, CAP) == 1, (fast, slow)
    assert fast.peak_shards > 1, (fast, slow)
    assert fast.shards >= 3 * slow.shards, (fast, slow)
