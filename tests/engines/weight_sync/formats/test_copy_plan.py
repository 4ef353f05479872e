"""CopyPlan: a loader's copies recorded once and replayed, checked against the
loader itself on a loader shaped like vLLM's (fused q/k/v, a tensor-parallel
shard, a padded vocabulary)."""

import pytest
import torch

from engines.weight_sync.formats.buckets import plan_buckets, unpack_bucket
from engines.weight_sync.formats.copy_plan import CopyPlan
from engines.weight_sync.formats.manifest import Manifest

HIDDEN, VOCAB, PADDED = 8, 10, 16


class FusedModel(torch.nn.Module):
    """What vLLM holds for one layer on tensor-parallel rank 1 of 2."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * HIDDEN, HIDDEN), requires_grad=False)
        self.down = torch.nn.Parameter(torch.zeros(HIDDEN, HIDDEN // 2), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(PADDED, HIDDEN), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.zeros(HIDDEN), requires_grad=False)


class VllmLikeLoader:
    """Name mapping, stacking and sharding the way vLLM's weight loaders do
    them (narrow + copy_, `param[:n].data.copy_`, `fill_` of the padding)."""

    def __init__(self, model, scale: float = 1.0):
        self.model, self.scale, self.calls = model, scale, 0

    def __call__(self, weights):
        self.calls += 1
        for name, w in weights:
            if self.scale != 1.0:
                w = w * self.scale  # a loader that computes: not replayable
            if name in ("q", "k", "v"):
                shard = "qkv".index(name)
                dst = self.model.qkv.data.narrow(0, shard * HIDDEN, HIDDEN)
                assert dst.shape == w.shape
                dst.copy_(w)
            elif name == "down":
                half = w.shape[1] // 2
                self.model.down.data.copy_(w.narrow(1, half, half))  # rank 1's columns
            elif name == "embed":
                self.model.embed[: w.shape[0]].data.copy_(w)
                self.model.embed[w.shape[0] :].data.fill_(0)
            elif name == "scale":
                w.shard_id = 0  # vLLM's name mapper tags tensors so
                assert len(w) == 1
                self.model.scale.data.copy_(w[w.shard_id])
            elif name == "tied_head":
                pass  # skipped, as vLLM skips a tied lm_head


def hf_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (HIDDEN, HIDDEN),
        "k": (HIDDEN, HIDDEN),
        "v": (HIDDEN, HIDDEN),
        "down": (HIDDEN, HIDDEN),
        "embed": (VOCAB, HIDDEN),
        "scale": (1, HIDDEN),
        "tied_head": (VOCAB, HIDDEN),
    }
    return [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]


def as_bucket_views(weights):
    """The tensors as a receiver sees them: views into one flat buffer."""
    plan = plan_buckets(Manifest.of(weights), bucket_bytes=1 << 20)
    (bucket,) = plan.buckets
    flat = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for entry, (_, tensor) in zip(bucket.entries, weights, strict=True):
        flat[entry.offset : entry.offset + entry.param.nbytes] = tensor.view(-1).view(torch.uint8)
    return unpack_bucket(bucket, flat)


def loaded_by_loader(weights):
    model = FusedModel().to(torch.bfloat16)
    VllmLikeLoader(model)(weights)
    return model


def assert_same_params(a, b):
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def test_replays_the_loaders_copies_without_calling_it():
    model = FusedModel().to(torch.bfloat16)
    loader = VllmLikeLoader(model)
    plan = CopyPlan(model, loader)
    plan.load(hf_weights(0))
    assert loader.calls == 1
    assert plan.refused is None
    assert plan.size == 6  # one per tensor but the skipped head

    # New values, arriving as views into a bucket at other offsets.
    new = as_bucket_views(hf_weights(1))
    plan.load(new)
    assert loader.calls == 1, "a known layout went through the loader again"
    assert_same_params(model, loaded_by_loader(hf_weights(1)))


def test_repeated_tensors_on_cpu_are_copied_without_a_graph():
    # CUDA graphs are for CUDA tensors; on CPU `repeat` changes nothing.
    model = FusedModel().to(torch.bfloat16)
    plan = CopyPlan(model, VllmLikeLoader(model))
    weights = hf_weights(0)
    plan.load(weights, repeat=True)
    with torch.no_grad():
        for _, tensor in weights:
            tensor.add_(1.0)
    plan.load(weights, repeat=True)
    assert not plan.captured and plan.graph_error is None
    assert_same_params(model, loaded_by_loader(weights))


def test_a_loader_that_computes_is_refused_and_keeps_loading_right():
    model = FusedModel().to(torch.bfloat16)
    loader = VllmLikeLoader(model, scale=2.0)
    plan = CopyPlan(model, loader)
    plan.load(hf_weights(0))
    assert plan.refused is not None and "mul" in plan.refused
    plan.load(hf_weights(1))
    assert loader.calls == 2
    expected = FusedModel().to(torch.bfloat16)
    VllmLikeLoader(expected, scale=2.0)(hf_weights(1))
    assert_same_params(model, expected)


@pytest.mark.parametrize("change", ["param_memory", "layout"])
def test_records_again_when_the_parameter_or_the_layout_changes(change):
    model = FusedModel().to(torch.bfloat16)
    loader = VllmLikeLoader(model)
    plan = CopyPlan(model, loader)
    plan.load(hf_weights(0))
    weights = hf_weights(1)
    if change == "param_memory":
        model.qkv.data = torch.zeros_like(model.qkv)
    else:
        weights = [(n, t.t().contiguous().t() if n == "q" else t) for n, t in weights]
    plan.load(weights)
    assert loader.calls == 2
    assert_same_params(model, loaded_by_loader(hf_weights(1)))


class VllmParameter(torch.nn.Parameter):
    """Like vLLM's BasevLLMParameter: a subclass with a Python __torch_function__."""

    def __new__(cls, data):
        return super().__new__(cls, data=data, requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_parameter_subclass_given_new_memory_is_recorded_again():
    # The plan checks addresses with subclass dispatch off (for speed): the
    # check must still see a vLLM-style parameter move.
    model = FusedModel().to(torch.bfloat16)
    model.qkv = VllmParameter(model.qkv.data)
    loader = VllmLikeLoader(model)
    plan = CopyPlan(model, loader)
    plan.load(hf_weights(0))
    plan.load(hf_weights(1))
    assert loader.calls == 1
    model.qkv.data = torch.zeros_like(model.qkv)
    plan.load(hf_weights(2))
    assert loader.calls == 2
    assert_same_params(model, loaded_by_loader(hf_weights(2)))


@pytest.mark.parametrize(
    "misuse",
    [
        lambda model, w: model.qkv.data.add_(w.sum()),  # reads values
        lambda model, w: torch.empty_like(w).copy_(w),  # copy into a temporary
        lambda model, w: w.mul_(1),  # in place on the incoming tensor
        lambda model, w: model.qkv.data[0, 0].fill_(w[0, 0].item()),
    ],
)
def test_other_uses_of_an_incoming_tensor_refuse_the_recording(misuse):
    model = FusedModel().to(torch.bfloat16)
    plan = CopyPlan(model, lambda weights: [misuse(model, w) for _, w in weights])
    plan.load(hf_weights(0)[:1])
    assert plan.refused is not None
    assert plan.size == 0


def test_the_later_of_two_tensors_writing_one_place_wins_as_in_the_loader():
    model = FusedModel().to(torch.bfloat16)

    def overwriting(weights):
        for _, w in weights:
            model.scale.data.copy_(w)

    plan = CopyPlan(model, overwriting)
    a, b = torch.full((HIDDEN,), 1.0), torch.full((HIDDEN,), 2.0)
    plan.load([("b", b)])  # "b" recorded alone first
    for _ in range(2):  # then both: through the loader, then replayed
        plan.load([("a", a), ("b", b)])
        assert torch.equal(model.scale, b.to(torch.bfloat16))
