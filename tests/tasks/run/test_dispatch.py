"""Pull-based dispatch on a real Ray with fake engines (scripted delays and
deaths; no model): fast engines take more work, a dead or hung engine loses
only its unfinished shards, and every prompt ends up in exactly one shard."""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest
import ray

from engines import EngineDeadError, EngineSet, EngineTimeoutError, PromptTooLongError
from engines.config import EngineConfig
from engines.load import EngineLoad
from engines.outputs import CompletionOutput, RequestOutput
from tasks.run.dispatch import run_shards
from tasks.run.pool import EnginePool
from tasks.run.shards import plan_shards


@ray.remote(num_cpus=0)
class FakeEngine:
    """Answers `generate_text` after `delay_s`; with `die_on_call=k` its
    process exits on the k-th request; `reject` fails requests for that prompt.
    It runs `batch` requests at once; the rest wait (its load says so)."""

    def __init__(
        self, name: str, delay_s: float = 0.0, die_on_call=None, reject=None, batch: int = 1000
    ):
        self.name, self.delay_s, self.die_on_call, self.reject = name, delay_s, die_on_call, reject
        self.calls = self.active = 0
        self.batch = batch
        self.room = asyncio.Semaphore(batch)

    async def generate_text(self, prompt, params):
        self.calls += 1
        if self.calls == self.die_on_call:
            os._exit(1)
        if prompt == self.reject:
            raise PromptTooLongError("prompt 0 has 9999 tokens")
        self.active += 1
        try:
            async with self.room:
                await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        completion = CompletionOutput(0, [1, 2], "xy", "length")
        return RequestOutput("r", [3], [completion], weight_version=0, engine=self.name)

    async def load(self):
        running = min(self.active, self.batch)
        return EngineLoad(running, self.active - running, running / self.batch)


def fake_pool(*specs: dict) -> EnginePool:
    names = [f"fake-{i}" for i in range(len(specs))]
    configs = [
        EngineConfig(
            name=n, pretrain="fake", max_len=8, seed=0, gpu_memory_utilization=0.5, rpc_timeout_s=10
        )
        for n in names
    ]
    handles = [FakeEngine.remote(n, **spec) for n, spec in zip(names, specs, strict=True)]
    # Up before the dispatch, whose per-shard deadlines would otherwise also
    # count the actors' start (seconds on a loaded box).
    ray.get([handle.__ray_ready__.remote() for handle in handles], timeout=120)
    return EnginePool(
        EngineSet(
            handles,
            configs=configs,
            name_prefix="fake",
            namespace="t",
            backend="fake",
            placement=None,
        )
    )


class Recorder:
    """Collects finished shards, as the shard store would."""

    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.done: dict[int, tuple[str, list]] = {}

    def submit(self, engine, shard):
        handle = self.pool.engines[engine]
        return [handle.generate_text.remote(f"p{i}", None) for i in range(shard.start, shard.stop)]

    def on_done(self, shard, engine, results, seconds):
        assert shard.index not in self.done, "a shard was written twice"
        assert len(results) == len(shard)
        self.done[shard.index] = (self.pool.name(engine), results)


@pytest.fixture
def kill_fakes(ray_local):
    pools = []
    yield pools.append
    for pool in pools:
        for handle in pool.engines:
            ray.kill(handle)


def test_fast_engine_pulls_more_work(kill_fakes):
    pool = fake_pool({"delay_s": 0.4}, {"delay_s": 0.0})
    kill_fakes(pool)
    recorder = Recorder(pool)
    shards = plan_shards(12, 1)
    run_shards(pool, shards, recorder.submit, recorder.on_done, per_engine=1, timeout_s=60)
    assert sorted(recorder.done) == list(range(12))
    by_engine = [name for name, _ in recorder.done.values()]
    # An even split would give each 6; pulling, the slow one gets very few.
    assert by_engine.count("fake-1") >= 9, by_engine
    assert pool.stats[1].generate_calls == by_engine.count("fake-1")


def test_dead_engine_loses_only_unfinished_shards(kill_fakes):
    pool = fake_pool({"delay_s": 0.05}, {"delay_s": 0.05, "die_on_call": 4})
    kill_fakes(pool)
    recorder = Recorder(pool)
    shards = plan_shards(20, 2)
    with pytest.raises(EngineDeadError, match="fake-1"):
        run_shards(pool, shards, recorder.submit, recorder.on_done, per_engine=1, timeout_s=60)
    assert list(pool.failed) == [1]
    assert pool.stats[1].failures == 1
    # fake-1 finished its first shard (calls 1-2) and died on the next one.
    assert [name for name, _ in recorder.done.values()].count("fake-1") == 1
    assert len(recorder.done) < len(shards)

    # The retry (here: the survivor alone) runs exactly what is missing.
    missing = [s for s in shards if s.index not in recorder.done]
    run_shards(pool, missing, recorder.submit, recorder.on_done, per_engine=1, timeout_s=60)
    assert sorted(recorder.done) == list(range(len(shards)))


def test_hung_engine_becomes_a_timeout(kill_fakes):
    pool = fake_pool({"delay_s": 0.0}, {"delay_s": 600.0})
    kill_fakes(pool)
    recorder = Recorder(pool)
    began = time.monotonic()
    with pytest.raises(EngineTimeoutError, match="fake-1 did not finish shard"):
        run_shards(
            pool, plan_shards(6, 1), recorder.submit, recorder.on_done, per_engine=1, timeout_s=2.0
        )
    assert time.monotonic() - began < 30
    assert list(pool.failed) == [1]
    assert all(name == "fake-0" for name, _ in recorder.done.values())


def test_rejected_request_fails_at_once_naming_the_prompt(kill_fakes):
    pool = fake_pool({"reject": "p5"})
    kill_fakes(pool)
    recorder = Recorder(pool)
    with pytest.raises(PromptTooLongError, match=re.escape("prompts file entry 5: prompt 0 has")):
        run_shards(
            pool, plan_shards(8, 2), recorder.submit, recorder.on_done, per_engine=1, timeout_s=60
        )
    assert not pool.failed  # not an engine failure: nothing to replace


def test_queued_requests_keep_an_engine_below_its_cap(kill_fakes):
    # fake-0 runs one request at a time: the others wait, so its window
    # stays small; fake-1 has room and grows to the cap.
    pool = fake_pool({"delay_s": 0.05, "batch": 1}, {"delay_s": 0.05})
    kill_fakes(pool)
    recorder = Recorder(pool)
    shards = plan_shards(60, 2)
    run_shards(pool, shards, recorder.submit, recorder.on_done, per_engine=4, timeout_s=60)
    assert sorted(recorder.done) == list(range(len(shards)))
    queued, roomy = pool.stats
    assert queued.shards + roomy.shards == len(shards)
    assert queued.peak_shards < roomy.peak_shards == 4, (queued, roomy)
    assert roomy.shards > 2 * queued.shards, (queued, roomy)
