"""A worker's loading rule: copy-plan replay only for the vLLM model classes
and quantizations proven equal to their own loader; any other vLLM model
(another class, or a proven class started quantized) goes through vLLM's
layerwise reload, or fails naming its class where vLLM is missing (here)."""

from __future__ import annotations

import pytest
import torch
from fake_engine import FakeWorker

from engines.weight_sync.errors import WeightSyncError
from engines.weight_sync.worker import WorkerWeights


class VllmShaped(torch.nn.Module):
    """A model with vLLM's `load_weights` entry point."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)


class LlamaForCausalLM(VllmShaped):
    pass


class Qwen2MoeForCausalLM(VllmShaped):
    pass


def test_a_proven_class_replays_its_recorded_copies():
    model = LlamaForCausalLM()
    worker = WorkerWeights(FakeWorker(model))
    for value in (1.0, 2.0, 3.0):
        worker.load([("weight", torch.full((3,), value))])
    assert torch.equal(model.weight, torch.full((3,), 3.0))
    assert model.calls == 1  # recorded once, then replayed
    assert worker.copy_plan_status()["copies"] == 1


@pytest.mark.parametrize(
    ("model_class", "quantization"),
    [(Qwen2MoeForCausalLM, None), (LlamaForCausalLM, "fp8")],
    ids=["unproven-class", "proven-class-quantized"],
)
def test_an_unproven_pair_is_not_replayed_and_needs_vllms_reload(model_class, quantization):
    model = model_class()
    worker = WorkerWeights(FakeWorker(model, quantization=quantization))
    name = model_class.__name__
    assert not worker.replays()
    refused = worker.copy_plan_status()["refused"]
    assert f"{name} (quantization {quantization}) is not proven" in refused
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(
            WeightSyncError, match=rf"{name} \(quantization {quantization}\) is not"
        ):
            worker.load([("weight", torch.ones(3))])
        assert model.calls == 0
    else:  # with vLLM: tests/gpu/test_gpu_architectures.py, test_gpu_weight_formats.py
        pytest.skip("vLLM is installed: the reload path is tested on the GPU hosts")
