"""vLLM's native weight-transfer API into our engines: a trainer written to
vLLM 0.26's docs (`vllm/distributed/weight_transfer/`) drives real engines
(Ray actors, the CPU backend, the tiny model) through the four methods of
vLLM's `VLLMWeightSyncClient`.

vLLM cannot be installed on these CPU hosts, so `RayClient` below is vLLM's
`RayVLLMWeightSyncClient` (clients.py) line for line, with a deadline added
to its `ray.get`; and the trainer's data plane is vLLM's
`NCCLWeightTransferEngine.trainer_send_weights` (nccl_engine.py, packed and
not) over a gloo group instead of PyNccl, which needs a GPU. The GPU test with
vLLM's own classes: tests/gpu/test_gpu_weight_sync.py.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM
from waiting import SETUP_TIMEOUT_S

from engines import SamplingParams, create_vllm_engines, destroy_engines
from engines.client import get
from engines.weight_sync.config import DEFAULT_GROUP_NAME, GroupInfo
from engines.weight_sync.errors import ManifestMismatchError
from engines.weight_sync.group import WeightGroup, free_port

TIMEOUT_S = 60.0
# vLLM's request classes are importable wherever vLLM is; these copies are
# not importable by the engine actors, so they travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- vLLM's client (vllm/distributed/weight_transfer/clients.py, base.py) ------------------
@dataclass
class WeightTransferInitRequest:
    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    update_info: dict[str, Any] = field(default_factory=dict)


class RayClient:
    """vLLM's `RayVLLMWeightSyncClient`."""

    def __init__(self, handle) -> None:
        self.handles = handle if isinstance(handle, list) else [handle]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        request = WeightTransferInitRequest(init_info=init_info)
        ray.get(
            [h.init_weight_transfer_engine.remote(request) for h in self.handles],
            timeout=TIMEOUT_S,
        )

    def start_weight_update(self) -> None:
        ray.get([h.start_weight_update.remote() for h in self.handles], timeout=TIMEOUT_S)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        request = WeightTransferUpdateRequest(update_info=update_info)
        ray.get([h.update_weights.remote(request) for h in self.handles], timeout=TIMEOUT_S)

    def finish_weight_update(self) -> None:
        ray.get([h.finish_weight_update.remote() for h in self.handles], timeout=TIMEOUT_S)


# --- the trainer's data plane (nccl_engine.trainer_send_weights, packed_tensor.py) ---------
def send_one_by_one(group: WeightGroup, weights: list[tuple[str, torch.Tensor]]) -> None:
    for _, tensor in weights:
        group.broadcast(tensor, src=0)


def send_packed(group: WeightGroup, weights: list[tuple[str, torch.Tensor]], size: int) -> None:
    """`packed_nccl_broadcast_producer`: uint8 views concatenated until a chunk
    holds more than `size` bytes."""
    chunk: list[torch.Tensor] = []
    total = 0
    for _, tensor in weights:
        flat = tensor.contiguous().view(torch.uint8).view(-1)
        chunk.append(flat)
        total += flat.numel()
        if total > size:
            group.broadcast(torch.cat(chunk), src=0)
            chunk, total = [], 0
    if chunk:
        group.broadcast(torch.cat(chunk), src=0)


# --- the test --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model, ray_local_module):
    engines = create_vllm_engines(
        1, tiny_model, max_len=128, gpu_memory_utilization=0.5, backend="hf", name_prefix="native"
    )
    ray.get(engines[0].ready.remote(), timeout=SETUP_TIMEOUT_S)
    yield engines[0]
    destroy_engines(engines)


@pytest.fixture(scope="module")
def trainer(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model


def update_info(weights, **extra) -> dict[str, Any]:
    return {
        "names": [n for n, _ in weights],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
        **extra,
    }


def prompt_logprobs(engine, prompt: list[int]) -> list[float]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (out,) = get(engine.generate.remote([prompt], params), TIMEOUT_S)
    return [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]


def trainer_logprobs(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    chosen = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])
    return chosen[:, 0].tolist()


@pytest.mark.parametrize("packed", [False, True])
def test_a_trainer_written_to_vllms_api_syncs_our_engine(engine, trainer, packed):
    client = RayClient(engine)
    info = GroupInfo("127.0.0.1", free_port(), 2, DEFAULT_GROUP_NAME, "gloo", TIMEOUT_S)
    # vLLM's trainer_init: the trainer opens rank 0 while the engine joins.
    joined = threading.Thread(
        target=client.init_weight_transfer_engine,
        args=(
            {
                "master_address": "127.0.0.1",
                "master_port": info.master_port,
                "rank_offset": 1,
                "world_size": 2,
            },
        ),
    )
    joined.start()
    group = WeightGroup(info, rank=0)
    joined.join(TIMEOUT_S)
    version = get(engine.health.remote(), TIMEOUT_S)["weight_version"]
    try:
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        weights = [(n, p.detach()) for n, p in trainer.named_parameters()]
        client.start_weight_update()
        extra = {"packed": True, "packed_buffer_size_bytes": 64 * 1024} if packed else {}
        # NCCL's update_weights runs beside the trainer's broadcast.
        update = threading.Thread(
            target=client.update_weights, args=(update_info(weights, **extra),)
        )
        update.start()
        if packed:
            send_packed(group, weights, 64 * 1024)
        else:
            send_one_by_one(group, weights)
        update.join(TIMEOUT_S)
        assert not update.is_alive()
        client.finish_weight_update()
    finally:
        group.destroy()
    health = get(engine.health.remote(), TIMEOUT_S)
    assert (health["weight_version"], health["stale"]) == (version + 1, False)
    got = get(engine.read_weights.remote([n for n, _ in weights]), TIMEOUT_S)
    for name, tensor in weights:
        assert torch.equal(got[name], tensor), name
    prompt = list(range(5, 40))
    diff = max(
        abs(a - b)
        for a, b in zip(
            prompt_logprobs(engine, prompt), trainer_logprobs(trainer, prompt), strict=True
        )
    )
    assert diff < 1e-4


def test_a_wrong_shape_is_refused_before_any_byte_moves(engine, trainer):
    client = RayClient(engine)
    version = get(engine.health.remote(), TIMEOUT_S)["weight_version"]
    before = get(engine.read_weights.remote(["model.norm.weight"]), TIMEOUT_S)
    client.start_weight_update()
    wrong = [("model.norm.weight", torch.zeros(3))]
    with pytest.raises(ManifestMismatchError, match=r"'model.norm.weight': shape \[3\]"):
        client.update_weights(update_info(wrong))
    health = get(engine.health.remote(), TIMEOUT_S)
    assert (health["weight_version"], health["stale"], health["paused"]) == (version, False, False)
    after = get(engine.read_weights.remote(["model.norm.weight"]), TIMEOUT_S)
    assert torch.equal(after["model.norm.weight"], before["model.norm.weight"])


# --- a LoRA adapter over vLLM's API (engines/weight_sync/lora/) ----------------------------
@pytest.fixture(scope="module")
def lora_engine(tiny_model, ray_local_module):
    engines = create_vllm_engines(
        1,
        tiny_model,
        max_len=128,
        backend="hf",
        name_prefix="native-lora",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,  # what the engine keeps when no trainer of ours says
    )
    ray.get(engines[0].ready.remote(), timeout=SETUP_TIMEOUT_S)
    yield engines[0]
    destroy_engines(engines)


def joined_group(client: RayClient) -> WeightGroup:
    """vLLM's `trainer_init`: the trainer opens rank 0 while the engine joins."""
    info = GroupInfo("127.0.0.1", free_port(), 2, DEFAULT_GROUP_NAME, "gloo", TIMEOUT_S)
    init = {"master_address": "127.0.0.1", "master_port": info.master_port}
    joined = threading.Thread(
        target=client.init_weight_transfer_engine,
        args=({**init, "rank_offset": 1, "world_size": 2},),
    )
    joined.start()
    group = WeightGroup(info, rank=0)
    joined.join(TIMEOUT_S)
    return group


@pytest.mark.parametrize("packed", [False, True])
def test_an_adapter_over_vllms_api_serves_the_merged_model(lora_engine, tiny_model, packed):
    """vLLM's API moves named tensors only: the engine reads the adapter's
    rank and targets from them and takes scaling 1, so the trainer sends
    lora_B scaled by alpha / rank."""
    from peft import LoraConfig, get_peft_model

    engine, client = lora_engine, RayClient(lora_engine)
    rank, alpha = 4, 16.0
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "v_proj"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    trainer = get_peft_model(base, config, adapter_name="default").eval()
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    sent = [
        (n.replace(".default.", "."), p.detach() * (alpha / rank if ".lora_B." in n else 1.0))
        for n, p in trainer.named_parameters()
        if "lora_" in n
    ]
    version = get(engine.health.remote(), TIMEOUT_S)["weight_version"]
    group = joined_group(client)
    try:
        client.start_weight_update()
        extra = {"packed": True, "packed_buffer_size_bytes": 1024} if packed else {}
        update = threading.Thread(target=client.update_weights, args=(update_info(sent, **extra),))
        update.start()
        if packed:
            send_packed(group, sent, 1024)
        else:
            send_one_by_one(group, sent)
        update.join(TIMEOUT_S)
        assert not update.is_alive()
        client.finish_weight_update()
    finally:
        group.destroy()
    health = get(engine.health.remote(), TIMEOUT_S)
    assert (health["weight_version"], health["stale"]) == (version + 1, False)
    assert f"rolloutflow-v{version + 1}" in get(engine.lora_adapters.remote(), TIMEOUT_S)
    merged = trainer.merge_and_unload()
    prompt = list(range(5, 40))
    ours, theirs = prompt_logprobs(engine, prompt), trainer_logprobs(merged, prompt)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert max(abs(a - b) for a, b in zip(ours, trainer_logprobs(plain, prompt), strict=True)) > 0.1
