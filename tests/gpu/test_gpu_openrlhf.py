"""An OpenRLHF v0.11.2 trainer on the second GPU drives our engine on the
first: engines created with OpenRLHF's keywords, its weight group (vLLM's
`StatelessProcessGroup` + `PyNcclCommunicator`, openrlhf/utils/distributed_util.py),
its broadcast loop (`update_weight` per parameter, `empty_cache=True` on the
last, openrlhf/trainer/ray/ppo_actor.py broadcast_to_vllm), then the engine
generates what the trainer's weights generate. Needs two GPUs.

And OpenRLHF's colocated path on one GPU: `_handle_cuda_ipc` (copied from
ppo_actor.py) sends `reduce_tensor`'s `(rebuild_fn, args)` per parameter;
the engine then generates greedily what a fresh engine loaded from the
trainer's checkpoint generates."""

from __future__ import annotations

import socket
import sys

import gpu_helpers
import pytest
from gpu_helpers import (
    SYNCED_MAX_ABS,
    SYNCED_MEAN_ABS,
    assert_logprob_parity,
    vllm_engine,
    wait_gpus_released,
    wait_ready,
)
from openrlhf_calls import create_call

from engines import SamplingParams, create_vllm_engines, destroy_engines

pytestmark = pytest.mark.gpu

TIMEOUT_S = 300
PROMPT = [7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)


class OpenRLHFTrainer:
    """Rank 0 of the weight group, as OpenRLHF's PolicyModelActor is."""

    def __init__(self, pretrain: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(pretrain, dtype=torch.bfloat16)
        self.model.to("cuda").eval()
        # A training step's worth of change, seeded.
        generator = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator, device="cuda") * 0.02)

    def sync(self, engines: list) -> int:
        import ray
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        # ppo_actor.py _init_vllm_group (world: the trainer + one TP=1 engine).
        master_address = ray._private.services.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            master_port = sock.getsockname()[1]
        refs = [
            engine.init_process_group.remote(
                master_address, master_port, i + 1, 2, "openrlhf", backend="nccl", use_ray=False
            )
            for i, engine in enumerate(engines)
        ]
        # distributed_util.py stateless_init_process_group
        pg = StatelessProcessGroup.create(
            host=master_address, port=master_port, rank=0, world_size=len(engines) + 1
        )
        group = PyNcclCommunicator(pg, device=torch.cuda.current_device())
        ray.get(refs, timeout=TIMEOUT_S)
        # ppo_actor.py broadcast_to_vllm / _broadcast_param
        params = list(self.model.named_parameters())
        for count, (name, param) in enumerate(params, start=1):
            refs = [
                engine.update_weight.remote(
                    name, dtype=param.dtype, shape=param.shape, empty_cache=count == len(params)
                )
                for engine in engines
            ]
            group.broadcast(param.data, src=0, stream=torch.cuda.current_stream())
            ray.get(refs, timeout=TIMEOUT_S)
        return len(params)

    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        return gpu_helpers.reference_logprobs(self.model, prompt, completion)


def test_openrlhf_trainer_syncs_and_the_engine_follows(
    ray_gpu, gpu_model, gpu_count, gpu_baseline, hf_reference
):
    if gpu_count < 2:
        pytest.skip("the trainer needs a GPU of its own (NCCL refuses one shared GPU)")
    ray = ray_gpu
    engines = create_vllm_engines(
        **create_call(gpu_model, max_model_len=2048, gpu_memory_utilization=0.3, backend="vllm")
    )
    # Ray workers cannot import tests/gpu: ship this code by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(gpu_helpers)
    trainer = ray.remote(OpenRLHFTrainer).options(num_gpus=1).remote(gpu_model)
    try:
        wait_ready(engines, "1 engine for an OpenRLHF trainer")
        engine = engines[0]
        before = ray.get(engine.generate.remote(PROMPT, GREEDY), timeout=TIMEOUT_S).outputs[0]
        assert_logprob_parity(hf_reference, PROMPT, before)
        sent = ray.get(trainer.sync.remote(list(engines)), timeout=TIMEOUT_S)
        health = ray.get(engine.health.remote(), timeout=TIMEOUT_S)
        assert health["weight_version"] == 1 and not health["paused"], health
        after = ray.get(engine.generate.remote(PROMPT, GREEDY), timeout=TIMEOUT_S)
        assert after.weight_versions == [1]
        completion = after.outputs[0]
        ours = [
            e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        theirs = ray.get(
            trainer.logprobs.remote(PROMPT, list(completion.token_ids)), timeout=TIMEOUT_S
        )
        diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
        print(f"{sent} tensors sent; engine vs trainer logprobs: max |diff| {max(diffs):.4f}")
        # The trainer perturbed the weights: the bound of a synced engine
        # (2026-11-30, H200 x2: max 0.0749, mean 0.0225 after this sync).
        assert max(diffs) < SYNCED_MAX_ABS and sum(diffs) / len(diffs) < SYNCED_MEAN_ABS
        assert completion.token_ids != before.token_ids  # the weights did move
    finally:
        ray.kill(trainer)
        destroy_engines(engines)
        wait_gpus_released(gpu_baseline)


# --- OpenRLHF's colocated path (CUDA IPC) on one GPU -----------------------------------------
# 64 greedy prompts: the synced engine against a fresh one loaded from the
# trainer's checkpoint. Issue 32 measured 62 of 64 equal with the handles
# sent as args alone, 0 of 64 before the sync: the same bf16 weights, but
# vLLM's kernels are not batch-invariant, so a near-tie can flip a greedy
# token between two engines; 60 leaves room for that, not for a bad sync.
COLOCATED_PROMPTS = [[3 + (11 * i + 7 * j) % 250 for j in range(8)] for i in range(64)]
COLOCATED_GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
EQUAL_MIN = 60


def get_physical_gpu_id():
    # openrlhf/trainer/ray/utils.py (0.11.2), copied: its package imports
    # vLLM and DeepSpeed's trainer code on import, and the GPU bundle has no
    # OpenRLHF.
    import torch

    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    return str(props.uuid)


class OpenRLHFColocatedTrainer:
    """OpenRLHF's PolicyModelActor with `colocate_all` on one rank: weights
    sent by `_handle_cuda_ipc`, as in openrlhf/trainer/ray/ppo_actor.py."""

    def __init__(self, pretrain: str, checkpoint: str):
        import shutil
        from pathlib import Path

        import torch
        import torch.distributed
        from transformers import AutoModelForCausalLM

        # `_handle_cuda_ipc` gathers the handles over torch.distributed: a
        # group of this one rank.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
        self.model = AutoModelForCausalLM.from_pretrained(pretrain, dtype=torch.bfloat16)
        self.model.to("cuda").eval()
        generator = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator, device="cuda") * 0.02)
        # The trainer's checkpoint, with the tokenizer files of the model it started from.
        self.model.save_pretrained(checkpoint)
        for path in Path(pretrain).iterdir():
            if path.suffix != ".safetensors" and not (Path(checkpoint) / path.name).exists():
                shutil.copy(path, checkpoint)

    def broadcast_to_vllm(self, vllm_engines: list) -> int:
        import ray
        import torch

        # ppo_actor.py broadcast_to_vllm, the colocated branch (ZeRO stage < 3,
        # no DeepSpeed gather).
        torch.cuda.empty_cache()
        model = self.model
        count = 0

        def _handle_cuda_ipc(param, count, num_params):
            from torch.multiprocessing.reductions import reduce_tensor

            weight = param.data.clone()
            ipc_handle = reduce_tensor(weight)

            ipc_handle = {get_physical_gpu_id(): ipc_handle}
            ipc_handle_list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ipc_handle_list, ipc_handle)

            if torch.distributed.get_rank() == 0:
                ipc_handles = {}
                for d in ipc_handle_list:
                    ipc_handles.update(d)

                shape = param.shape
                refs = [
                    engine.update_weight_cuda_ipc.remote(
                        name,
                        dtype=param.dtype,
                        shape=shape,
                        ipc_handles=ipc_handles,
                        empty_cache=count == num_params,
                    )
                    for engine in vllm_engines
                ]
                ray.get(refs)
            torch.distributed.barrier()  # torch_dist_barrier_and_cuda_sync
            torch.cuda.synchronize()

        params_to_sync = list(model.named_parameters())
        num_params = len(params_to_sync)
        # `name` is read by _handle_cuda_ipc's closure, as upstream.
        for name, param in params_to_sync:  # noqa: B007
            count += 1  # empty_cache at last param
            _handle_cuda_ipc(param, count, num_params)
        torch.cuda.empty_cache()
        return num_params


def greedy(ray, engine) -> list[list[int]]:
    outputs = ray.get(
        engine.generate.remote(COLOCATED_PROMPTS, COLOCATED_GREEDY), timeout=TIMEOUT_S
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_openrlhf_colocated_cuda_ipc_sync_generates_as_its_checkpoint(
    ray_gpu, gpu_model, gpu_baseline, tmp_path
):
    ray = ray_gpu
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    checkpoint = str(tmp_path / "trainer-checkpoint")
    pg = placement_group([{"GPU": 1, "CPU": 2}])
    ray.get(pg.ready(), timeout=60)
    engines = vllm_engine(gpu_model, "orlhf-ipc", shared_pg=pg)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    on_the_engines_gpu = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    trainer = (
        ray.remote(OpenRLHFColocatedTrainer)
        .options(num_cpus=0.2, num_gpus=0.2, scheduling_strategy=on_the_engines_gpu)
        .remote(gpu_model, checkpoint)
    )
    reloaded = []
    try:
        wait_ready(engines, "1 engine colocated with an OpenRLHF trainer")
        engine = engines[0]
        before = greedy(ray, engine)
        sent = ray.get(trainer.broadcast_to_vllm.remote(list(engines)), timeout=TIMEOUT_S)
        health = ray.get(engine.health.remote(), timeout=TIMEOUT_S)
        assert health["weight_version"] == 1 and not health["stale"], health
        synced = greedy(ray, engine)
        ray.kill(trainer)
        destroy_engines(engines)
        wait_gpus_released(gpu_baseline)
        reloaded = vllm_engine(checkpoint, "orlhf-reload", shared_pg=pg)
        wait_ready(reloaded, "1 engine loaded from the trainer's checkpoint")
        expected = greedy(ray, reloaded[0])
        equal = sum(a == b for a, b in zip(synced, expected, strict=True))
        equal_before = sum(a == b for a, b in zip(before, expected, strict=True))
        print(
            f"{sent} tensors sent by _handle_cuda_ipc; greedy outputs equal to the reloaded "
            f"checkpoint's: {equal} of 64 after the sync, {equal_before} of 64 before"
        )
        assert equal >= EQUAL_MIN and equal_before < 8, (equal, equal_before)
    finally:
        ray.kill(trainer)
        destroy_engines(engines)
        destroy_engines(reloaded)
        remove_placement_group(pg)
        wait_gpus_released(gpu_baseline)
