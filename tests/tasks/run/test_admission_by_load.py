"""Admission by load with real CPU engines on a real Ray: an engine slowed
down (it runs one request at a time, `max_num_seqs=1`: the others wait in
its queue and its shards take several times as long) is kept at a small
window and gets a small share of the work."""

from __future__ import annotations

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
            engine_kwargs={"max_num_seqs": max_num_seqs},
        )
        for i, max_num_seqs in enumerate([64, 1])
    ]
    handles = [ray.remote(HFEngine).options(num_cpus=0).remote(c) for c in configs]
    ray.get([handle.ready.remote() for handle in handles], timeout=300)
    yield EngineSet(
        handles, configs=configs, name_prefix="load", namespace="t", backend="hf", placement=None
    )
    for handle in handles:
        ray.kill(handle)


def test_idle_engine_reports_no_load(engines):
    assert ray.get(engines[0].load.remote(), timeout=60) == EngineLoad(0, 0, 0.0)


def test_a_slowed_engine_gets_a_small_window_and_less_work(engines):
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
    assert fast.shards + slow.shards == len(shards)
    # Its queue holds waiting requests and its shards take several times as
    # long: the slowed engine never gets near the cap, the other does the bulk.
    assert slow.peak_shards <= 2 < CAP, (fast, slow)
    assert fast.shards >= 2 * slow.shards, (fast, slow)
    assert pool.windows.allowed(1, CAP) == 1
