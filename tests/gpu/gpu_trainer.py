"""The trainer of the GPU weight-sync tests and benchmark: the reference
policy (training/policy.py) on a GPU, in the engines' serving dtype."""

from __future__ import annotations

import sys
from typing import Any

import fp8_emulation
from policy_probes import PolicyProbes

from engines.weight_sync.formats import ipc_handles as ipc
from training.config import PolicyConfig
from training.policy import ReferencePolicy


class BF16Policy(PolicyProbes, ReferencePolicy):
    def __init__(self, config: PolicyConfig | dict):
        import torch

        super().__init__(config)
        # ReferencePolicy loads float32; bf16 engines accept weights in their
        # serving dtype only (their manifest says bf16).
        self.model.to(torch.bfloat16)

    def gpu_uuid(self) -> str:
        import torch

        return ipc.gpu_uuid(torch.cuda.current_device())

    def fp8_sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """`sequence_logprobs` as vLLM 0.26's online FP8 computes them on an
        H200 (tests/fp8_emulation.py)."""
        with fp8_emulation.fp8_computed(self.model):
            return self.sequence_logprobs(sequences)

    def sync_with_vllm_api(self, engines: list[Any], packed: bool = False) -> None:
        """Sync as a trainer written to vLLM 0.26's docs does (CUDA IPC
        backend, vLLM's own client and trainer code, nothing of ours)."""
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        client = RayVLLMWeightSyncClient(list(engines))
        client.init_weight_transfer_engine({})
        client.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(
            iter(list(self.model.named_parameters())),
            {"send_mode": "ray", "llm_handle": list(engines), "packed": packed},
        )
        client.finish_weight_update()


def ship_by_value(*modules: Any) -> None:
    """Ray pickles classes by reference and its workers cannot import this
    directory (tests/gpu) nor tests/: the trainer's modules, and `modules`,
    go by value instead."""
    import ray

    own = (sys.modules[__name__], sys.modules[PolicyProbes.__module__], fp8_emulation)
    for module in own + modules:
        ray.cloudpickle.register_pickle_by_value(module)


def start_bf16_policy(pretrain: str, **options: Any):
    """BF16Policy as a Ray actor (`options`: num_gpus, scheduling_strategy, ...)."""
    import ray

    ship_by_value()
    config = PolicyConfig(pretrain=pretrain, device="cuda", sync_timeout_s=120.0)
    return ray.remote(BF16Policy).options(max_restarts=0, **options).remote(config.model_dump())
