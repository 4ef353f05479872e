"""OpenRLHF's per-parameter transport on a fake engine over a real gloo group:
the trainer (rank 0, a thread here) broadcasts each tensor right after
`update_weight`, as OpenRLHF's `_broadcast_to_vllm` does. The same with real
engines and a trainer process: test_sync_into_engines.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fake_engine import FakeEngine, join, run, state

from engines.weight_sync.errors import ManifestMismatchError
from engines.weight_sync.group import WeightGroup


class Tiny(torch.nn.Module):
    """Embeddings and a head: the parameters a vocabulary resize changes."""

    def __init__(self, vocab: int = 10, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = torch.nn.Embedding(vocab, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, vocab, bias=False)


async def send(engine, group: WeightGroup, name: str, tensor, empty_cache: bool = False):
    call = asyncio.create_task(
        engine.update_weight(name, tensor.dtype, list(tensor.shape), empty_cache=empty_cache)
    )
    await asyncio.to_thread(group.broadcast, tensor.detach().clone(), 0)
    await call


@pytest.mark.parametrize("empty_cache_last", [True, False])
def test_a_stream_commits_when_complete_with_or_without_a_final_empty_cache(empty_cache_last):
    engine = FakeEngine(Tiny(seed=0))
    trained = state(Tiny(seed=1))

    async def sync():
        group = await join(engine)
        try:
            names = list(trained)
            for i, name in enumerate(names):
                last = i == len(names) - 1
                await send(
                    engine, group, name, trained[name], empty_cache=last and empty_cache_last
                )
                if not last:  # not served half-loaded
                    assert engine.weight_version == 0 and engine.paused
            # Committed on the call that completed the set: no stall, nothing stale.
            assert (engine.weight_version, engine.stale, engine.paused) == (1, False, False)
            assert engine.weights.open is None
            # The next stream is the next version.
            for name in names:
                await send(engine, group, name, trained[name] * 2)
            assert engine.weight_version == 2
        finally:
            group.destroy()
            await engine.destroy_weight_group()

    run(sync())
    for name, tensor in engine.worker.model.named_parameters():
        assert torch.equal(tensor.detach(), trained[name] * 2), name


def test_a_partial_stream_without_empty_cache_stays_open_until_it_is_complete():
    engine = FakeEngine(Tiny(seed=0))
    trained = state(Tiny(seed=1))

    async def sync():
        group = await join(engine)
        try:
            await send(engine, group, "norm.weight", trained["norm.weight"])
            assert engine.weights.open is not None and engine.paused
            status = await engine.weight_status()
            assert (status.version, status.syncing) == (0, 1)
            await engine.abort_weight_sync("the test gives up")
        finally:
            group.destroy()
            await engine.destroy_weight_group()

    run(sync())
    assert (engine.weight_version, engine.stale, engine.paused) == (0, True, False)


def test_resized_embeddings_are_refused_naming_both_sizes():
    engine = FakeEngine(Tiny(vocab=10, seed=0))
    before = state(engine.worker.model)
    resized = Tiny(vocab=12, seed=1).embed_tokens.weight

    async def sync():
        group = await join(engine)
        try:
            await send(engine, group, "embed_tokens.weight", resized)
        finally:
            group.destroy()
            await engine.destroy_weight_group()

    with pytest.raises(
        ManifestMismatchError, match="trainer sends 12 vocabulary rows, the engine holds 10"
    ):
        run(sync())
    # Received (the trainer is not left in the collective) but not loaded.
    for name, tensor in engine.worker.model.named_parameters():
        assert torch.equal(tensor.detach(), before[name]), name
    assert (engine.weight_version, engine.paused) == (0, False)


class LlamaForCausalLM(torch.nn.Module):
    """vLLM-shaped (`load_weights`) over a transformers MoE model: it takes
    the fused expert names, as vLLM 0.26's MoE loader does, while its
    manifest is the checkpoint's, per expert. Named as a class whose loading
    is replayed, so it loads without vLLM."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)


def test_a_stream_of_fused_moe_experts_completes_a_per_expert_manifest(tmp_path):
    from architectures import build, write
    from transformers import AutoModelForCausalLM

    from engines.weight_sync.transports import checkpoint

    path = write("qwen3-moe", tmp_path / "model")
    inner = build("qwen3-moe", seed=3, vocab_size=320).to(torch.bfloat16)
    engine = FakeEngine(LlamaForCausalLM(inner))
    engine.worker._weight_worker().expected = checkpoint.read_manifest(path)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    trained = state(trainer)
    assert any(name.endswith("experts.gate_up_proj") for name in trained)

    async def sync():
        group = await join(engine)
        try:
            names = list(trained)
            for i, name in enumerate(names):
                await send(engine, group, name, trained[name])  # never empty_cache
                if i < len(names) - 1:
                    assert engine.weight_version == 0 and engine.paused
            assert (engine.weight_version, engine.stale, engine.paused) == (1, False, False)
        finally:
            group.destroy()
            await engine.destroy_weight_group()

    run(sync())
    for name, tensor in engine.worker.model.inner.named_parameters():
        assert torch.equal(tensor.detach(), trained[name]), name
