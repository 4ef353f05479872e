"""The bucketed broadcast's receiving side into a model that is not replayed:
vLLM's layerwise reload keeps the tensors it is given until their layer is
whole (vllm/model_executor/model_loader/reload/layerwise.py), which may be
after later buckets have arrived; so those buckets must not share buffers.
The loader here keeps what it is given to the end, as that reload may."""

from __future__ import annotations

import asyncio

import torch
from fake_engine import FakeEngine, join, run

from engines.weight_sync.formats.buckets import iter_buckets, pack_bucket, plan_buckets
from engines.weight_sync.formats.manifest import Manifest


class Qwen3MoeForCausalLM(torch.nn.Module):
    """vLLM-shaped (`load_weights`), of a class not proven for replay."""

    def load_weights(self, weights):
        raise AssertionError("loads go through the reload, patched below")


def test_buckets_loaded_by_a_reload_keep_their_own_buffers():
    engine = FakeEngine(Qwen3MoeForCausalLM())
    worker = engine.worker._weight_worker()
    weights = [(f"layers.{i}.weight", torch.full((256,), float(i))) for i in range(12)]
    manifest = Manifest.of(weights)
    worker.expected = manifest
    kept: list[tuple[str, torch.Tensor]] = []
    worker._reload = kept.extend  # keeps the views it is given, copies nothing
    plan = plan_buckets(manifest, bucket_bytes=2048)  # two tensors a bucket: six buckets
    assert len(plan.buckets) > 2

    async def sync():
        group = await join(engine)
        try:
            await engine.begin_weight_sync(1, manifest.plain)
            receive = asyncio.create_task(
                engine.receive_weight_buckets(plan.model_dump(mode="json"))
            )

            def send() -> None:
                for bucket, tensors in iter_buckets(plan, weights):
                    group.broadcast(pack_bucket(bucket, tensors), src=0)

            await asyncio.to_thread(send)
            await receive
            await engine.finish_weight_sync(1)
        finally:
            group.destroy()
            await engine.destroy_weight_group()

    run(sync())
    assert engine.weight_version == 1
    assert [name for name, _ in kept] == [name for name, _ in weights]
    for (name, got), (_, sent) in zip(kept, weights, strict=True):
        assert torch.equal(got, sent), name
