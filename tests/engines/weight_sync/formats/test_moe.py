"""A transformers-5 trainer's fused MoE experts against a vLLM engine's
manifest (the per-expert checkpoint `save_pretrained` writes), on tiny random
Qwen2-MoE and Qwen3-MoE models. vLLM 0.26 loads the fused tensors as they
are (`RoutedExperts.load_weights`: unbind by expert, gate/up halves by
`chunk(2, dim=1)`); that this split is the checkpoint's, bit for bit, is
checked here on transformers' own save; the load itself on the GPU
(tests/gpu/test_gpu_weight_formats.py)."""

from __future__ import annotations

import pytest
import torch
from architectures import write
from fake_engine import FakeWorker
from safetensors.torch import load_file

from engines.weight_sync.formats.manifest import Manifest, ParamSpec, mismatches
from engines.weight_sync.formats.moe import in_engine_layout, per_expert
from engines.weight_sync.transports import checkpoint
from engines.weight_sync.worker import WorkerWeights

MOE = ("qwen2-moe", "qwen3-moe")


class Qwen3MoeForCausalLM(torch.nn.Module):
    """A vLLM-shaped model (it has `load_weights`): its manifest is the checkpoint's."""

    def load_weights(self, weights):
        raise AssertionError("a manifest check loads nothing")


@pytest.fixture(params=MOE)
def moe_checkpoint(request, tmp_path):
    """The checkpoint an engine starts from, and a trainer that loaded it
    (transformers fuses the experts as it loads)."""
    from transformers import AutoModelForCausalLM

    path = write(request.param, tmp_path / request.param)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def test_the_trainers_fused_experts_fit_the_checkpoints_per_expert_manifest(moe_checkpoint):
    path, trainer = moe_checkpoint
    engine = checkpoint.read_manifest(path)
    sent = Manifest.of(trainer.named_parameters())
    fused = [n for n in sent.names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused and not set(fused) & set(engine.names)
    assert mismatches(engine, sent, allow_partial=True)  # as the names come: refused
    seen = in_engine_layout(sent, engine.names)
    assert mismatches(engine, seen, allow_partial=True) == []
    # Every tensor the checkpoint names is covered, once: nothing left unsent.
    assert sorted(seen.names) == sorted(engine.names)


def test_vllms_split_of_a_fused_expert_is_the_checkpoints_tensor(moe_checkpoint):
    path, trainer = moe_checkpoint
    saved = load_file(str(path / "model.safetensors"))
    checked = 0
    for name, fused in trainer.named_parameters():
        split = per_expert(ParamSpec(name=name, dtype=fused.dtype, shape=tuple(fused.shape)))
        if split is None:
            continue
        # As RoutedExperts.load_weights: unbind experts, chunk gate/up on dim 1.
        halves = fused.chunk(2, dim=1) if name.endswith("gate_up_proj") else (fused,)
        tensors = [half[e] for e in range(fused.shape[0]) for half in halves]
        for spec, tensor in zip(split, tensors, strict=True):
            assert tuple(tensor.shape) == spec.shape
            assert torch.equal(saved[spec.name], tensor), spec.name
            checked += 1
    assert checked == sum(1 for n in saved if ".experts." in n)


def test_a_vllm_worker_checks_fused_experts_per_expert(moe_checkpoint):
    path, trainer = moe_checkpoint
    worker = WorkerWeights(FakeWorker(Qwen3MoeForCausalLM()))
    worker.expected = checkpoint.read_manifest(path)
    sent = Manifest.of(trainer.named_parameters())
    assert worker.weight_manifest_problems(sent.plain) == []
    # Refused naming the per-expert tensor: an expert the engine lacks, an
    # expert matrix transposed.
    layer = "model.layers.0.mlp.experts"
    experts, hidden, inner = dict(trainer.named_parameters())[f"{layer}.down_proj"].shape
    more = ParamSpec(name=f"{layer}.down_proj", dtype="bfloat16", shape=(5, hidden, inner))
    assert worker.problems_of([more]) == [
        f"'{layer}.4.down_proj.weight': the engine has no such parameter"
    ]
    if hidden != inner:
        turned = ParamSpec(name=f"{layer}.down_proj", dtype="bfloat16", shape=(4, inner, hidden))
        (first, *_) = worker.problems_of([turned])
        assert first.startswith(f"'{layer}.0.down_proj.weight': shape [{inner}, {hidden}]"), first


def test_only_fused_expert_tensors_are_split():
    engine = Manifest(
        params=(ParamSpec(name="m.experts.gate_up_proj", dtype="bfloat16", shape=(2, 8, 4)),)
    )
    held = in_engine_layout(engine, engine.names)
    assert held == engine  # the engine holds the fused name itself (the CPU engine)
    for name, shape in [
        ("m.mlp.gate_up_proj", (2, 8, 4)),  # not an experts module
        ("m.experts.gate_up_proj", (8, 4)),  # not 3-D
        ("m.experts.gate_up_proj", (2, 7, 4)),  # gate and up cannot be halves
    ]:
        assert per_expert(ParamSpec(name=name, dtype="bfloat16", shape=shape)) is None
    split = per_expert(ParamSpec(name="m.experts.gate_up_proj", dtype="float32", shape=(2, 8, 4)))
    assert [(s.name, s.shape) for s in split] == [
        ("m.experts.0.gate_proj.weight", (4, 4)),
        ("m.experts.0.up_proj.weight", (4, 4)),
        ("m.experts.1.gate_proj.weight", (4, 4)),
        ("m.experts.1.up_proj.weight", (4, 4)),
    ]
