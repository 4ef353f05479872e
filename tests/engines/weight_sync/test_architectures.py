"""Every CPU transport into every architecture the CPU engine runs: random
tiny models built from transformers configs in the layouts of Llama 3, Qwen2
(tied embeddings), Qwen3, Mistral, Gemma 2, Qwen2-MoE and Qwen3-MoE (fused
experts, as transformers 5 holds them on both sides). The engine side is
the real session and worker (`fake_engine.py` stands in for the actor only);
the trainer is another instance of the same architecture. After each sync
the engine's weights are the trainer's, bit for bit, and so are its logits
(bound: 0, the same transformers code on the same weights on one CPU).

vLLM's loaders and copy-plan replay on these layouts need vLLM:
tests/gpu/test_gpu_architectures.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from architectures import ARCHITECTURES, build
from fake_engine import FakeEngine, join, run

from engines.weight_sync.formats.buckets import bucket_key, iter_buckets, pack_bucket, plan_buckets
from engines.weight_sync.formats.checksum import checksum, checksums
from engines.weight_sync.formats.manifest import Manifest, dtype_name
from engines.weight_sync.transports import checkpoint

TRANSPORTS = ("checkpoint", "broadcast", "openrlhf", "vllm_native")
TOKENS = torch.tensor([[3, 17, 42, 8, 91, 5, 60, 23, 11, 77]])


async def by_checkpoint(engine, weights, version, tmp_path):
    path = str(checkpoint.save(weights, tmp_path / "ckpt", version=version))
    manifest = checkpoint.read_manifest(path).model_dump(mode="json")
    await engine.begin_and_receive(version, manifest, "load_weights_from_path", [path, True])
    await engine.finish_weight_sync(version, checksums(weights))


async def by_broadcast(engine, weights, version, tmp_path):
    group = await join(engine)
    try:
        manifest = Manifest.of(weights)
        plan = plan_buckets(manifest, bucket_bytes=16 * 1024)
        await engine.begin_weight_sync(version, manifest.plain)
        receive = asyncio.create_task(engine.receive_weight_buckets(plan.model_dump(mode="json")))
        sums = {}

        def send() -> None:
            for index, (bucket, tensors) in enumerate(iter_buckets(plan, weights)):
                flat = pack_bucket(bucket, tensors)
                sums[bucket_key(index)] = checksum(flat)
                group.broadcast(flat, src=0)

        await asyncio.to_thread(send)
        await receive
        await engine.finish_weight_sync(version, sums)
    finally:
        group.destroy()


async def by_openrlhf(engine, weights, version, tmp_path):
    group = await join(engine)
    try:
        for i, (name, tensor) in enumerate(weights):
            call = asyncio.create_task(
                engine.update_weight(
                    name, tensor.dtype, list(tensor.shape), empty_cache=i == len(weights) - 1
                )
            )
            await asyncio.to_thread(group.broadcast, tensor.clone(), 0)
            await call
    finally:
        group.destroy()


async def by_vllm_native(engine, weights, version, tmp_path):
    group = await join(engine)
    try:
        await engine.start_weight_update()
        info = {
            "names": [n for n, _ in weights],
            "dtype_names": [dtype_name(t.dtype) for _, t in weights],
            "shapes": [list(t.shape) for _, t in weights],
            "packed": True,
            "packed_buffer_size_bytes": 16 * 1024,
        }
        update = asyncio.create_task(engine.update_weights({"update_info": info}))

        def send() -> None:  # vLLM's packed producer
            chunk, total = [], 0
            for _, tensor in weights:
                chunk.append(tensor.contiguous().view(torch.uint8).view(-1))
                total += chunk[-1].numel()
                if total > info["packed_buffer_size_bytes"]:
                    group.broadcast(torch.cat(chunk), src=0)
                    chunk, total = [], 0
            if chunk:
                group.broadcast(torch.cat(chunk), src=0)

        await asyncio.to_thread(send)
        await update
        await engine.finish_weight_update()
    finally:
        group.destroy()


SYNCS = {
    "checkpoint": by_checkpoint,
    "broadcast": by_broadcast,
    "openrlhf": by_openrlhf,
    "vllm_native": by_vllm_native,
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_transport_syncs_every_architecture(arch, transport, tmp_path):
    engine = FakeEngine(build(arch, seed=0))
    trainer = build(arch, seed=1)
    weights = [(n, p.detach()) for n, p in trainer.named_parameters()]
    model = engine.worker.model
    with torch.no_grad():
        assert not torch.equal(model(TOKENS).logits, trainer(TOKENS).logits)

    async def sync():
        try:
            await SYNCS[transport](engine, weights, 1, tmp_path)
        finally:
            await engine.destroy_weight_group()

    run(sync())
    assert (engine.weight_version, engine.stale, engine.paused) == (1, False, False)
    state = dict(model.named_parameters())
    for name, tensor in weights:
        assert torch.equal(state[name], tensor), name
    if trainer.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, trainer(TOKENS).logits)
